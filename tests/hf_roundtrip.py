#!/usr/bin/env python3
"""Hugging Face weights in and out, checked by transformers itself (ctest hf_roundtrip).

  hf_roundtrip.py BUILD_DIR

For a grouped-query model and a tied-embedding one:
  1. transformers builds a random LlamaForCausalLM and saves it; fsdp.cpp loads it sharded over 2
     ranks (--init-from's loader) and its logits on the same tokens match transformers'.
  2. fsdp-train starts from those weights, trains 3 steps and exports; transformers loads the
     export and its logits match fsdp.cpp's on the exported weights, which training changed.
  3. fsdp-train trains a model from scratch and exports it: the same check.
Tolerance: float32 logits of two implementations of this model (dim 64, 2 layers) that sum in
different orders: each logit ends a chain of about 20 sums of at most 256 terms, so the
relative difference stays below 2 * 10 * sqrt(20 * 256) * 2^-24 = 8.5e-5 of the logits' scale
(tests/helpers.h's bound); checked at 1e-4 of the largest logit.
"""
import os
import subprocess
import sys
import tempfile

import torch
import transformers

BUILD = sys.argv[1]
RUN = [f"{BUILD}/fsdp-run", "-n", "2", "--cpu"]
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def fsdp_logits(model_dir, work):
    tokens, out = f"{work}/tokens.bin", f"{work}/logits.bin"
    TOKENS.numpy().astype("<i8").tofile(tokens)
    subprocess.run(RUN + [f"{BUILD}/tests/fsdp_hf_logits", model_dir, tokens, "2", "16", out], check=True)
    return torch.frombuffer(bytearray(open(out, "rb").read()), dtype=torch.float32).view(2, 16, -1)


def hf_logits(model_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def check(what, got, want):
    worst = (got - want).abs().max().item()
    scale = want.abs().max().item()
    ok = got.shape == want.shape and worst <= 1e-4 * scale
    print(f"hf_roundtrip: {what}: largest logit difference {worst:.3g} (scale {scale:.3g}): {'ok' if ok else 'FAIL'}")
    if not ok:
        sys.exit(1)


def train(work, name, *flags):
    out = f"{work}/{name}"
    subprocess.run(RUN + [f"{BUILD}/fsdp-train", "--steps", "3", "--seq", "32", "--batch", "2",
                          "--log", f"{work}/{name}.jsonl", "--export", out, *flags], check=True)
    return out


def main():
    for tied, kv_heads in ((False, 2), (True, 4)):
        label = "tied embeddings" if tied else "grouped-query attention"
        with tempfile.TemporaryDirectory() as work:
            config = transformers.LlamaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
            torch.manual_seed(0)
            original = f"{work}/hf"
            transformers.LlamaForCausalLM(config).save_pretrained(original, safe_serialization=True)
            want = hf_logits(original)
            check(f"{label}: transformers' model loaded into fsdp.cpp", fsdp_logits(original, work), want)

            tuned = train(work, "tuned", "--init-from", original)
            after = hf_logits(tuned)
            if (after - want).abs().max().item() < 1e-3:
                sys.exit("hf_roundtrip: FAIL: the exported model equals the initial one: no training?")
            check(f"{label}: fine-tuned by fsdp.cpp, exported, loaded by transformers", fsdp_logits(tuned, work), after)

            scratch = train(work, "scratch", "--model", "tiny", *(["--tie-embeddings"] if tied else []))
            check(f"{label}: trained from scratch, exported, loaded by transformers",
                  fsdp_logits(scratch, work), hf_logits(scratch))
    print("hf_roundtrip: ok")


if __name__ == "__main__":
    main()
