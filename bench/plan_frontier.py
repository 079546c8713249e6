#!/usr/bin/env python3
"""The planner's proof from `fsdp-train --plan-check FILE`'s lines:

  - prediction error: each schedule's predicted against measured step time and peak allocated;
  - the frontier: measured time against peak for no recomputation, full recomputation and each
    budget's plan, with the straight line between the two fixed points, whether each plan sits on
    or below it and under its budget;
  - with --fsdp2 "FLAGS": PyTorch FSDP2 (bench/fsdp2_llama.py, eager) run with each schedule's
    checkpointed blocks (the choice it can express), on the same GPUs.

Writes OUT/plan.md, OUT/plan.json and, where matplotlib is installed, OUT/frontier.png.
  python3 bench/plan_frontier.py --check plan-check.jsonl --out DIR [--fsdp2 "--model 1b ..."] [--world 2]
"""
import argparse
import json
import os
import shlex
import subprocess
import sys

import step_log

GIB = 2**30


def run_fsdp2(flags, blocks, world, out):
    """Median step time (steps 3 on) and peak allocated of FSDP2 with these blocks checkpointed."""
    name = "fsdp2-ckpt-" + ("-".join(map(str, blocks)) if blocks else "none")
    log = os.path.join(out, name + ".jsonl")
    with open(os.path.join(out, name + ".log"), "w") as console:
        status = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={world}", "bench/fsdp2_llama.py", *shlex.split(flags),
                                  "--recompute-blocks", ",".join(map(str, blocks)), "--jsonl", log],
                                 stdout=console, stderr=subprocess.STDOUT)
    if status != 0 or not os.path.exists(log):
        return None
    rows = step_log.read(log)
    return dict(ms=step_log.median_step_ms(rows, 2),
                peak_gib=max(r["peak_alloc_gib"] for r in rows))


def error(predicted, measured):
    return (predicted - measured) / measured * 100


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", required=True, help="fsdp-train --plan-check output (JSONL)")
    p.add_argument("--out", required=True)
    p.add_argument("--fsdp2", help="fsdp2_llama.py flags (model, seq, batch, steps) to run each schedule with")
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = step_log.read(args.check)
    none = next(r for r in rows if r["name"] == "no recomputation")
    full = next(r for r in rows if r["name"] == "full recomputation")
    lines = ["| schedule | checkpointed | predicted ms | measured ms | each round | error | predicted peak GiB | "
             "measured peak GiB | error | budget GiB | under budget | on/below the line | FSDP2 ms | FSDP2 peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    span = none["measured_peak_bytes"] - full["measured_peak_bytes"]
    for r in rows:
        r["ms_error_pct"] = error(r["predicted_ms"], r["measured_ms"])
        r["peak_error_pct"] = error(r["predicted_peak_bytes"], r["measured_peak_bytes"])
        share = (r["measured_peak_bytes"] - full["measured_peak_bytes"]) / span if span else 0
        r["line_ms"] = full["measured_ms"] + share * (none["measured_ms"] - full["measured_ms"])
        planned = r["budget_bytes"] > 0
        r["under_budget"] = r["measured_peak_bytes"] <= r["budget_bytes"] if planned else None
        r["below_line"] = r["measured_ms"] <= r["line_ms"] * 1.02 if planned else None  # 2%: run-to-run noise
        r["fsdp2"] = run_fsdp2(args.fsdp2, r["recomputed_blocks"], args.world, args.out) if args.fsdp2 else None
        yes = lambda v: "" if v is None else ("yes" if v else "**no**")
        f2 = r["fsdp2"] or {}
        lines.append(f"| {r['name']} | {len(r['recomputed_blocks'])} | {r['predicted_ms']:.1f} | "
                     f"{r['measured_ms']:.1f} | {' / '.join(f'{x:.1f}' for x in r.get('round_ms', []))} | "
                     f"{r['ms_error_pct']:+.1f}% | {r['predicted_peak_bytes'] / GIB:.2f} | "
                     f"{r['measured_peak_bytes'] / GIB:.2f} | {r['peak_error_pct']:+.1f}% | "
                     f"{r['budget_bytes'] / GIB if planned else 0:.2f} | {yes(r['under_budget'])} | "
                     f"{yes(r['below_line'])} | {f2.get('ms', float('nan')):.1f} | {f2.get('peak_gib', float('nan')):.2f} |")
    worst_ms = max(abs(r["ms_error_pct"]) for r in rows)
    worst_peak = max(abs(r["peak_error_pct"]) for r in rows)
    lines.append(f"\nLargest error: step time {worst_ms:.1f}%, peak {worst_peak:.1f}% over {len(rows)} schedules.")
    with open(os.path.join(args.out, "plan.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "plan.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plan_frontier: no matplotlib, no frontier.png")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ends = [full, none]
    ax.plot([r["measured_peak_bytes"] / GIB for r in ends], [r["measured_ms"] for r in ends], "k--", lw=1,
            label="straight line: full to no recomputation")
    planned = [r for r in rows if r["budget_bytes"] > 0]
    ax.scatter([r["measured_peak_bytes"] / GIB for r in planned], [r["measured_ms"] for r in planned],
               c="tab:blue", zorder=3, label="fsdp.cpp, planned for a budget")
    for r in planned:
        ax.axvline(r["budget_bytes"] / GIB, color="tab:blue", alpha=0.15, lw=1)
    ax.scatter([r["measured_peak_bytes"] / GIB for r in ends], [r["measured_ms"] for r in ends], c="k", marker="s",
               zorder=3, label="fsdp.cpp, full / no recomputation")
    with_fsdp2 = [r for r in rows if r["fsdp2"]]
    if with_fsdp2:
        ax.scatter([r["fsdp2"]["peak_gib"] for r in with_fsdp2], [r["fsdp2"]["ms"] for r in with_fsdp2],
                   c="tab:orange", marker="^", zorder=3, label="PyTorch FSDP2 eager, same checkpointed blocks")
    ax.set_xlabel("peak allocated per GPU (GiB); faint lines: the budgets")
    ax.set_ylabel("step time (ms, median)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "frontier.png"), dpi=120)


if __name__ == "__main__":
    main()
