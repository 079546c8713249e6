"""A Hugging Face Llama folder with a released model's shapes but only a few of its blocks, random
weights: what fsdp-train --init-from profiles when the whole model does not fit the GPUs at hand
(a 70B's blocks measured on 2 GPUs, then bench/stretch_cost_model.py carries the
cost model to all 80; the 8B's first 8 blocks, run_bench.py's one-GPU 8b-8l). transformers lays out the tensors (their names and shapes); the values are
normal(0, 0.02), norms 1, written as bf16 safetensors.

    python3 bench/llama_slice.py --model 70b --layers 4 --out /tmp/llama-70b-4

With --config-only it writes config.json alone: the shapes `fsdp-train --project --project-tp`
splits a stretched cost model by (--init-from the folder), no weights.
"""
import argparse
import os

import torch
import transformers
from safetensors.torch import save_file

# Llama-3.1's released configurations (config.json's fields), less the number of blocks.
MODELS = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                num_hidden_layers=80),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=8),  # the CPU test's
}
LLAMA_31 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192),
                tie_word_embeddings=False, torch_dtype="bfloat16")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--layers", type=int, required=True, help="blocks to keep (the released model's: " +
                   ", ".join(f"{k} {v['num_hidden_layers']}" for k, v in MODELS.items()) + ")")
    p.add_argument("--out", required=True, help="a folder that does not exist yet")
    p.add_argument("--config-only", action="store_true", help="write config.json alone, no weights")
    args = p.parse_args()
    full = MODELS[args.model]["num_hidden_layers"]
    if not 1 <= args.layers <= full:
        p.error(f"--layers {args.layers}: the {args.model} has {full} blocks; give 1 to {full}")
    if os.path.exists(args.out):
        p.error(f"--out {args.out} exists: give a new folder (nothing is overwritten)")
    config = transformers.LlamaConfig(**{**LLAMA_31, **MODELS[args.model], "num_hidden_layers": args.layers})
    if args.config_only:
        os.makedirs(args.out)
        config.save_pretrained(args.out)
        print(f"llama_slice: {args.out}: the {args.model}'s config.json, {args.layers} of {full} blocks, no weights")
        return
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            weights[name] = (torch.randn(shape, generator=generator, device=device) * 0.02).bfloat16().cpu()
    os.makedirs(args.out)
    config.save_pretrained(args.out)
    save_file(weights, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    count = sum(t.numel() for t in weights.values())
    print(f"llama_slice: {args.out}: the {args.model}'s shapes, {args.layers} of {full} blocks, "
          f"{count / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
