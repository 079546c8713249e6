"""A run's step log (JSONL, a row a step, as fsdp-train and bench/fsdp2_llama.py write them) and
the one way the benchmarks read a speed from it: the median step time of the steps after a
warm-up (the first steps compile, grow the allocator's pool and record the execution order)."""

import json
import statistics


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def timed(rows, warmup):
    """The steps after the first `warmup` (all of them if the run was that short)."""
    return rows[warmup:] or rows


def median_step_ms(rows, warmup):
    return statistics.median(r["step_ms"] for r in timed(rows, warmup))
