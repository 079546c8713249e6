#!/usr/bin/env python3
"""Hugging Face weights in and out, checked by transformers itself (ctest hf_roundtrip).

  hf_roundtrip.py BUILD_DIR

For a grouped-query model, a tied-embedding one and one with Llama 3's RoPE scaling:
  1. transformers builds a random LlamaForCausalLM and saves it; fsdp.cpp loads it sharded over 2
     ranks (--init-from's loader) and its logits on the same tokens match transformers'.
  2. fsdp-train starts from those weights, trains 3 steps and exports; transformers loads the
     export and its logits match fsdp.cpp's on the exported weights, which training changed.
  3. fsdp-train trains a model from scratch and exports it: the same check (not for the scaled
     RoPE: only the 3b preset has it, too big for this test).
  4. --steps 0 converts an import: a bf16 export split into small files with their index, every
     tensor exactly the float32 one rounded to bf16, which transformers loads.
  5. What an import carries passes through the export: every config.json field (bos/eos token ids
     included; torch_dtype says what was written), generation_config.json and the tokenizer files.
     An existing export is refused, or with --overwrite replaced whole. A directory with two sets
     of weights, or an index that disagrees with its files, is refused naming both; so are --seq
     above max_position_embeddings and --model beside a config.json.
  6. Imports that would train the wrong thing are refused: a tied config.json whose file holds an
     lm_head.weight of its own, weights holding NaN, and a text --data beside an imported model
     (bytes are not its tokenizer's ids); fsdp-prepare-data tokenises that text with the model's
     own tokenizer (made here) into a token file fsdp-train then trains on.
Tolerance: float32 logits of two implementations of this model (dim 64, 2 layers) that sum in
different orders: each logit ends a chain of about 20 sums of at most 256 terms, so the
relative difference stays below 2 * 10 * sqrt(20 * 256) * 2^-24 = 8.5e-5 of the logits' scale
(tests/lib/helpers.h's bound); checked at 1e-4 of the largest logit.
"""
import json
import os
import shutil
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
    subprocess.run(RUN + [f"{BUILD}/tests/trainer/fsdp_hf_logits", model_dir, tokens, "2", "16", out], check=True)
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


def run_train(*flags):
    done = subprocess.run(RUN + [f"{BUILD}/fsdp-train", *flags], capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def expect_refused(what, code_wanted, message, *flags):
    code, out = run_train(*flags)
    ok = code == code_wanted and message in out
    print(f"hf_roundtrip: {what}: exit {code}: {'ok' if ok else 'FAIL'}")
    if not ok:
        sys.exit(f"hf_roundtrip: FAIL: wanted exit {code_wanted} and '{message}', got:\n{out}")


def save_tokenizer(directory):
    import tokenizers
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t7", eos_token="t9").save_pretrained(
        directory)


WEIGHTS = (".safetensors", ".safetensors.index.json")


def check_passes_through(original, exported):
    want, got = (json.load(open(f"{d}/config.json")) for d in (original, exported))
    changed = [k for k, v in want.items() if k not in ("torch_dtype", "dtype") and got.get(k) != v]
    companions = [n for n in os.listdir(original) if n != "config.json" and not n.endswith(WEIGHTS)]
    differ = [n for n in companions if not os.path.exists(f"{exported}/{n}")
              or open(f"{original}/{n}", "rb").read() != open(f"{exported}/{n}", "rb").read()]
    loaded = transformers.AutoConfig.from_pretrained(exported)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ok = (not changed and not differ and got.get("torch_dtype") == "float32" and loaded.bos_token_id == 7
          and loaded.eos_token_id == 9 and "generation_config.json" in companions
          and "tokenizer.json" in companions and tokenizer("t7 t9")["input_ids"] == [7, 9])
    print(f"hf_roundtrip: export keeps config fields {sorted(want)} and files {sorted(companions)}: "
          f"{'ok' if ok else 'FAIL'}")
    if not ok:
        sys.exit(f"hf_roundtrip: FAIL: fields changed {changed}, files differ {differ}, torch_dtype "
                 f"{got.get('torch_dtype')}, bos {loaded.bos_token_id}, eos {loaded.eos_token_id}")


def check_refusals(work, original, tuned):
    expect_refused("export into an existing model", 2,
                   f"--export: '{tuned}' already holds files: pass --overwrite-export",
                   "--steps", "1", "--seq", "32", "--init-from", original, "--export", tuned)
    stale = f"{tuned}/model-00001-of-00002.safetensors"
    shutil.copy(f"{tuned}/model.safetensors", stale)
    code, out = run_train("--steps", "1", "--seq", "32", "--batch", "2", "--init-from", original, "--export", tuned,
                          "--overwrite", "--log", f"{work}/overwrite.jsonl")
    if code != 0 or os.path.exists(stale) or not os.path.exists(f"{tuned}/model.safetensors"):
        sys.exit(f"hf_roundtrip: FAIL: --overwrite did not replace the export whole (exit {code}):\n{out}")
    print("hf_roundtrip: --overwrite replaces the export whole: ok")
    expect_refused("--seq above max_position_embeddings", 2,
                   "--seq 256 is more than the " + original + " model's 128 positions (max_position_embeddings",
                   "--seq", "256", "--init-from", original)
    expect_refused("--model beside config.json", 2, "--model would be ignored",
                   "--model", "small", "--init-from", original)
    code, out = run_train("--init-from", original, "--seq", "32", "--dry-run", "--export", f"{work}/dry")
    if code != 0 or f"for the {original} model" not in out or f"exports to {work}/dry" not in out:
        sys.exit(f"hf_roundtrip: FAIL: the dry run does not name the model it would train and export:\n{out}")
    print("hf_roundtrip: the dry run names the imported model: ok")
    twice = f"{work}/twice"
    shutil.copytree(original, twice)
    shutil.copy(f"{twice}/model.safetensors", f"{twice}/model-old.safetensors")
    expect_refused("two sets of weights", 1,
                   f"'{twice}/model-old.safetensors' and '{twice}/model.safetensors' both hold",
                   "--steps", "1", "--seq", "32", "--init-from", twice)
    indexed = f"{work}/indexed"
    shutil.copytree(original, indexed)
    with open(f"{indexed}/model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}, f)
    expect_refused("an index that disagrees with the files", 1,
                   f"'{indexed}/model.safetensors.index.json' puts 'model.embed_tokens.weight' in "
                   f"'{indexed}/model-00002-of-00002.safetensors', but '{indexed}/model.safetensors' holds it",
                   "--steps", "1", "--seq", "32", "--init-from", indexed)


def check_sharded_bf16_export(work, tuned):
    """--steps 0 converts an import: bf16 in files of at most 100 kB with their index, each tensor
    the float32 export's rounded to bf16 (exactly), loaded by transformers."""
    from safetensors.torch import load_file
    out = f"{work}/bf16"
    code, log = run_train("--steps", "0", "--init-from", tuned, "--export", out, "--export-dtype", "bf16",
                          "--export-shard-gb", "0.0001", "--log", f"{work}/convert.jsonl")
    if code != 0:
        sys.exit(f"hf_roundtrip: FAIL: --steps 0 --export-dtype bf16 (exit {code}):\n{log}")
    index = json.load(open(f"{out}/model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    want = load_file(f"{tuned}/model.safetensors")
    got = {}
    for name in files:
        part = load_file(f"{out}/{name}")
        size = sum(t.numel() * t.element_size() for t in part.values())
        if len(part) > 1 and size > 100_000:
            sys.exit(f"hf_roundtrip: FAIL: {name} holds {size} bytes in {len(part)} tensors, above --export-shard-gb")
        got.update(part)
    same = sorted(got) == sorted(want) and all(
        got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    total = sum(t.numel() * 2 for t in got.values())
    config = json.load(open(f"{out}/config.json"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype="auto")
    ok = (same and len(files) >= 3 and index["metadata"]["total_size"] == total and config["torch_dtype"] == "bfloat16"
          and loaded.dtype == torch.bfloat16 and all(files[i] == f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                     for i in range(len(files))))
    print(f"hf_roundtrip: bf16 export in {len(files)} files with their index, each tensor the fp32 one rounded, "
          f"loaded by transformers: {'ok' if ok else 'FAIL'}")
    if not ok:
        sys.exit(f"hf_roundtrip: FAIL: files {files}, same tensors {same}, total_size {index['metadata']} vs {total}, "
                 f"config dtype {config.get('torch_dtype')}, loaded {loaded.dtype}")


def edited_weights(original, work, name, edit):
    """A copy of the model directory `original` whose weights `edit` (a dict of tensors) changed."""
    from safetensors.torch import load_file, save_file
    copy = f"{work}/{name}"
    shutil.copytree(original, copy)
    weights = load_file(f"{copy}/model.safetensors")
    edit(weights)
    save_file(weights, f"{copy}/model.safetensors", metadata={"format": "pt"})
    return copy


def check_import_refusals(work, original):
    """`original` is a tied model with the tokenizer of save_tokenizer."""
    untied_head = edited_weights(original, work, "untied-head", lambda w: w.__setitem__(
        "lm_head.weight", w["model.embed_tokens.weight"] + 1))
    expect_refused("a tied config beside an lm_head.weight of its own", 1,
                   "config.json ties the embeddings (tie_word_embeddings: true) but lm_head.weight holds other values",
                   "--steps", "1", "--seq", "32", "--init-from", untied_head)
    # A directory name JSON must escape: the step log names the model by its --init-from path.
    same_head = edited_weights(original, work, 'same "head"', lambda w: w.__setitem__(
        "lm_head.weight", w["model.embed_tokens.weight"].clone()))
    code, out = run_train("--steps", "1", "--seq", "32", "--init-from", same_head, "--log", f"{work}/same-head.jsonl")
    if code != 0:
        sys.exit(f"hf_roundtrip: FAIL: a tied model saved with its head beside the embedding is refused:\n{out}")
    logged = json.loads(open(f"{work}/same-head.jsonl").readline())["model"]
    if logged != same_head:
        sys.exit(f"hf_roundtrip: FAIL: the step log names the model {logged!r}, not its --init-from {same_head!r}")
    print("hf_roundtrip: a tied model saved with an equal lm_head.weight loads, and the log names it: ok")
    nan = edited_weights(original, work, "nan", lambda w: w["model.layers.1.mlp.up_proj.weight"].view(-1).__setitem__(
        5, float("nan")))
    expect_refused("weights holding NaN", 1, "tensor 'model.layers.1.mlp.up_proj.weight' holds NaN or infinite values",
                   "--steps", "1", "--seq", "32", "--init-from", nan)
    text = f"{work}/notes.txt"
    with open(text, "w") as f:
        f.write(" ".join(f"t{(i * 7) % 256}" for i in range(600)))
    expect_refused("text beside an imported model", 2, f"--data: '{text}' is text, read one byte a token, but "
                   f"--init-from '{original}' brings a model whose token ids are its tokenizer's",
                   "--steps", "1", "--seq", "32", "--init-from", original, "--data", text)
    with open(f"{work}/notes.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"text": f"t{i} t{i + 1} t{i + 2}"}) + "\n")
    tokens = f"{work}/notes.bin"
    done = subprocess.run([f"{BUILD}/fsdp-prepare-data", "--tokenizer", original, text, f"{work}/notes.jsonl",
                           "--out", tokens], capture_output=True, text=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(original)
    want = tokenizer(open(text).read())["input_ids"] + [9]
    for i in range(3):
        want += tokenizer(f"t{i} t{i + 1} t{i + 2}")["input_ids"] + [9]
    header = torch.frombuffer(bytearray(open(tokens, "rb").read(1024)), dtype=torch.int32) if done.returncode == 0 else None
    got = (torch.frombuffer(bytearray(open(tokens, "rb").read()[1024:]), dtype=torch.int16).tolist()
           if done.returncode == 0 else None)
    if done.returncode != 0 or header[:3].tolist() != [20240520, 1, len(want)] or got != want:
        sys.exit(f"hf_roundtrip: FAIL: fsdp-prepare-data wrote {got} (header "
                 f"{None if header is None else header[:3].tolist()}), "
                 f"want {want}:\n{done.stdout}{done.stderr}")
    print(f"hf_roundtrip: fsdp-prepare-data: {len(want)} tokens of the model's own tokenizer: ok")
    code, out = run_train("--steps", "2", "--seq", "32", "--init-from", original, "--data", tokens,
                          "--log", f"{work}/prepared.jsonl")
    if code != 0 or "step    2/2" not in out:
        sys.exit(f"hf_roundtrip: FAIL: training on the prepared tokens:\n{out}")
    print("hf_roundtrip: the imported model trains on the prepared tokens: ok")
    done = subprocess.run([f"{BUILD}/fsdp-prepare-data", "--tokenizer", original, text, "--out", tokens],
                          capture_output=True, text=True)
    if done.returncode != 2 or "exists: pass --overwrite" not in done.stderr:
        sys.exit(f"hf_roundtrip: FAIL: fsdp-prepare-data replaced an existing file:\n{done.stderr}")
    print("hf_roundtrip: fsdp-prepare-data keeps an existing --out: ok")


def main():
    # Llama 3's RoPE scaling (Llama-3.2's), with an original context of 64 positions so that the
    # 16-dimension heads have kept, blended and divided frequencies.
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    for label, tied, kv_heads, rope in (("grouped-query attention", False, 2, None),
                                        ("tied embeddings", True, 4, None),
                                        ("llama3 RoPE scaling", True, 2, llama3)):
        with tempfile.TemporaryDirectory() as work:
            config = transformers.LlamaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=7, eos_token_id=9,
                **({"rope_parameters": rope} if rope else {}))
            torch.manual_seed(0)
            original = f"{work}/hf"
            transformers.LlamaForCausalLM(config).save_pretrained(original, safe_serialization=True)
            save_tokenizer(original)
            want = hf_logits(original)
            check(f"{label}: transformers' model loaded into fsdp.cpp", fsdp_logits(original, work), want)

            tuned = train(work, "tuned", "--init-from", original)
            after = hf_logits(tuned)
            if (after - want).abs().max().item() < 1e-3:
                sys.exit("hf_roundtrip: FAIL: the exported model equals the initial one: no training?")
            check(f"{label}: fine-tuned by fsdp.cpp, exported, loaded by transformers", fsdp_logits(tuned, work), after)
            check_passes_through(original, tuned)
            if label == "grouped-query attention":
                check_sharded_bf16_export(work, tuned)
                check_refusals(work, original, tuned)
            if label == "tied embeddings":
                check_import_refusals(work, original)
            if rope:
                continue  # the presets trained from scratch below have no scaling but the 3b's

            scratch = train(work, "scratch", "--model", "tiny", *(["--tie-embeddings"] if tied else []))
            check(f"{label}: trained from scratch, exported, loaded by transformers",
                  fsdp_logits(scratch, work), hf_logits(scratch))
    print("hf_roundtrip: ok")


if __name__ == "__main__":
    main()
