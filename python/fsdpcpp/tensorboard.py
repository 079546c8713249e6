"""fsdp-train's step log as TensorBoard scalars, written by TensorBoard's own writer
(torch.utils.tensorboard.SummaryWriter):

    python -m fsdpcpp.tensorboard DIR            # the JSON lines on stdin (fsdp-train --tensorboard DIR)
    python -m fsdpcpp.tensorboard DIR LOG.jsonl  # a finished run's log
"""
from __future__ import annotations

import json
import sys

# The step line's fields (trainer/train/step_log.cpp) and their TensorBoard tags.
SCALARS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "eval_loss": "eval/loss",
    "eval_ppl": "eval/perplexity", "tok_s": "perf/tokens_per_s", "step_ms": "perf/step_ms",
    "peak_alloc_gib": "memory/peak_allocated_gib", "peak_reserved_gib": "memory/peak_reserved_gib",
}


def scalars(record: dict) -> dict[str, float]:
    """The tags and values of one step line: SCALARS' fields that are numbers, and the model FLOP/s
    a GPU (6 FLOPs a weight a token plus attention, as fsdp-train counts them)."""
    out = {tag: float(record[key]) for key, tag in SCALARS.items()
           if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)}
    if all(isinstance(record.get(k), (int, float)) for k in ("flops_per_token", "tok_s", "world")):
        out["perf/tflops_per_gpu"] = record["flops_per_token"] * record["tok_s"] / max(record["world"], 1) / 1e12
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        print(f"fsdpcpp.tensorboard: error: {e}: pip install tensorboard", file=sys.stderr)
        return 2
    writer = SummaryWriter(argv[0])
    source = open(argv[1]) if len(argv) == 2 else sys.stdin
    for line in source:
        if not line.strip():
            continue
        record = json.loads(line)
        for tag, value in scalars(record).items():
            writer.add_scalar(tag, value, record["step"])
        writer.flush()  # each step visible while the run goes on
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
