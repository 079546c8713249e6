"""fsdp-train's step lines (trainer/train/step_log.cpp) as named scalars, for the metrics writers
(fsdpcpp.tensorboard, fsdpcpp.wandb)."""
from __future__ import annotations

import json
from typing import Iterable, Iterator

# The step line's fields and their names as scalars ("section/name", as both writers group them).
SCALARS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "eval_loss": "eval/loss",
    "eval_ppl": "eval/perplexity", "tok_s": "perf/tokens_per_s", "step_ms": "perf/step_ms",
    "peak_alloc_gib": "memory/peak_allocated_gib", "peak_reserved_gib": "memory/peak_reserved_gib",
}


def scalars(record: dict) -> dict[str, float]:
    """The names and values of one step line: SCALARS' fields that are numbers, and the model FLOP/s
    a GPU (6 FLOPs a weight a token plus attention, as fsdp-train counts them)."""
    out = {tag: float(record[key]) for key, tag in SCALARS.items()
           if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)}
    if all(isinstance(record.get(k), (int, float)) for k in ("flops_per_token", "tok_s", "world")):
        out["perf/tflops_per_gpu"] = record["flops_per_token"] * record["tok_s"] / max(record["world"], 1) / 1e12
    return out


def steps(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, float]]]:
    """(step, scalars) of each non-empty JSON line, as they come (stdin while a run goes on)."""
    for line in lines:
        if line.strip():
            record = json.loads(line)
            yield record["step"], scalars(record)
