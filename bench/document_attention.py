"""What attention within packed documents costs: fsdp-train's 1B shapes on one GPU (seq 2048,
batch 4, bf16), causal attention over each row against --attention-mask block_causal, on the same
token file of documents of a mean length (exponentially distributed lengths, each ended by id 2;
random ids otherwise: the loss is not the point, the kernels are). One process after the other on
the same GPU; the median step time after 5 warm-up steps, and the ratio.

    python3 bench/document_attention.py OUT_DIR [--doc-tokens 512] [--steps 20]
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_log  # noqa: E402

EOS = 2


def write_documents(path, tokens, mean_length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=tokens, dtype=np.uint32)
    ends = np.cumsum(rng.exponential(mean_length, size=2 * tokens // mean_length + 16).astype(np.int64) + 1)
    ids[ends[ends < tokens]] = EOS
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240801, 1, tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(ids.astype("<u4").tobytes())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--doc-tokens", type=int, default=512, help="mean document length")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--build", default="build")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    data = os.path.join(a.out, "documents.bin")
    write_documents(data, 4 * 2049 * (a.steps + 1), a.doc_tokens, vocab=32000)  # the 1b model's
    base = [f"{a.build}/fsdp-run", "--gpu", "-n", "1", f"{a.build}/fsdp-train", "--model", "1b", "--seq", "2048",
            "--batch", "4", "--param-dtype", "bf16", "--steps", str(a.steps), "--data", data, "--overwrite-log"]
    results = {}
    for mask in ("causal", "block_causal"):
        log = os.path.join(a.out, f"{mask}.jsonl")
        extra = ["--attention-mask", mask] + (["--eos-id", str(EOS)] if mask == "block_causal" else [])
        with open(os.path.join(a.out, f"{mask}.log"), "w") as out:
            subprocess.run(base + extra + ["--log", log], stdout=out, stderr=subprocess.STDOUT, check=True)
        results[mask] = step_log.median_step_ms(step_log.read(log), 5)
    row = {"what": "document_attention", "model": "1b", "seq": 2048, "batch": 4, "doc_tokens": a.doc_tokens,
           "causal_ms": results["causal"], "block_causal_ms": results["block_causal"],
           "ratio": results["block_causal"] / results["causal"]}
    print(json.dumps(row))
    with open(os.path.join(a.out, "document_attention.jsonl"), "w") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
