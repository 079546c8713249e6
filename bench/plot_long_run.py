#!/usr/bin/env python3
"""Plots a long fsdp-train run from its JSONL log: memory at the end of every step (allocated and
reserved on the GPU, host RSS) and step time, to show that nothing grows or drifts.

  python3 bench/plot_long_run.py LOG.jsonl OUT.png [--title TEXT]
"""
import argparse
import json
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("png")
    p.add_argument("--title", default="")
    a = p.parse_args()
    with open(a.log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in rows]
    gib = 2 ** 30
    fig, (mem, rss, time) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    mem.plot(steps, [r["alloc_end_bytes"] / gib for r in rows], label="allocated at step end")
    mem.plot(steps, [r["reserved_end_bytes"] / gib for r in rows], label="reserved at step end")
    mem.plot(steps, [r["peak_alloc_gib"] for r in rows], label="peak allocated in step", alpha=0.6)
    mem.set_ylabel("GPU memory (GiB)")
    mem.legend(loc="center right")
    rss.plot(steps, [r["rss_gib"] * 1024 for r in rows], color="tab:green")
    rss.set_ylabel("host RSS (MiB)")
    window = 50
    ms = [r["step_ms"] for r in rows]
    rolling = [statistics.median(ms[max(0, i - window):i + 1]) for i in range(len(ms))]
    time.plot(steps, ms, ",", color="tab:gray", label="step")
    time.plot(steps, rolling, color="tab:red", label=f"median of {window}")
    time.set_ylim(0, 2 * statistics.median(ms))
    time.set_ylabel("step time (ms)")
    time.set_xlabel("step")
    time.legend(loc="lower right")
    fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"plot_long_run: wrote {a.png}")


if __name__ == "__main__":
    main()
