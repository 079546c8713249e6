#!/usr/bin/env python3
"""What collectives beside compute cost, and how far the CPU ran ahead: a summary of fsdp.cpp's
Chrome traces (fsdp-train --trace, fsdpcpp.write_trace).

Per trace file: the blocks' compute time by phase (forward, recompute, backward, hand-off; the
root's spans are left out, its forward and backward enclose the others), the all-gathers' and
reduce-scatters' time, and how much of it ran beside the blocks' compute. From the host track:
how far ahead of the GPU the CPU ran (each block's compute span from its issue, args.issued_us,
to its start on the device, in ms, and how many groups had compute the CPU had issued and the
device had not started when it issued the next) and how long the CPU waited on the in-flight caps:
with the all-gather cap, never more than the prefetch depth plus the cap
(tests/trainer/launcher_tests.sh overlap). Comparing a run at --prefetch-depth 0 with one at depth 1
shows the contention the planner calibrates (docs/planner.md, "The calibration step"): compute
that grows and collectives that stretch when they share the GPU.

  python3 bench/trace_overlap.py run-rank0.json [more.json ...] [--json OUT]
"""
import argparse
import collections
import json
import statistics

COMPUTE, ALL_GATHER, REDUCE_SCATTER, HOST = 0, 1, 2, 5  # the trace's tracks (tid)


def busy(intervals):
    """The length of the union of (start, end) intervals."""
    total, current = 0.0, None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current:
                total += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return total + (current[1] - current[0] if current else 0.0)


def beside(intervals, compute):
    """Time of `intervals` that overlaps `compute` (spans on one stream: they do not overlap)."""
    return sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in intervals for cs, ce in compute)


def group_of(span):
    """The group a span is of: "backward #3 Block" -> "#3 Block" (its forward, recompute, hand-off)."""
    return span["name"].split(" ", 1)[1]


def run_ahead(blocks, waits):
    """The CPU's lead over the GPU from the blocks' compute spans, and its waits on the caps."""
    issued = sorted(blocks, key=lambda e: e["args"]["issued_us"])
    leads = [(e["ts"] - e["args"]["issued_us"]) / 1e3 for e in issued]
    ahead = [len({group_of(o) for o in issued[:i] if o["ts"] > e["args"]["issued_us"]}) for i, e in enumerate(issued)]
    waited = collections.defaultdict(lambda: [0, 0.0])
    for w in waits:  # "wait: all-gather cap, for #3 Block"
        cap = w["name"].split(": ", 1)[1].split(" cap", 1)[0]
        waited[cap][0] += 1
        waited[cap][1] += w["dur"] / 1e3
    return {"lead_ms_median": statistics.median(leads) if leads else 0.0, "lead_ms_max": max(leads, default=0.0),
            "groups_ahead_median": statistics.median(ahead) if ahead else 0, "groups_ahead_max": max(ahead, default=0),
            "cap_waits": {cap: {"times": n, "ms": ms} for cap, (n, ms) in waited.items()}}


def summarise(path):
    everything = json.load(open(path))["traceEvents"]
    # HSDP's all-reduce track (tid 3) is not summarised here.
    events = [e for e in everything if e.get("ph") == "X" and e["tid"] <= REDUCE_SCATTER]
    roots = {group_of(e) for e in events if e["tid"] == COMPUTE and encloses(e, events)}
    phases = collections.defaultdict(float)
    tracks = {COMPUTE: [], ALL_GATHER: [], REDUCE_SCATTER: []}
    for e in events:
        span = (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
        if e["tid"] == COMPUTE and group_of(e) in roots:
            continue
        tracks[e["tid"]].append(span)
        if e["tid"] == COMPUTE:
            phases[e["name"].split()[0]] += span[1] - span[0]
    compute = tracks[COMPUTE]
    blocks = [e for e in events if e["tid"] == COMPUTE and group_of(e) not in roots
              and "issued_us" in e.get("args", {})]
    waits = [e for e in everything if e.get("ph") == "X" and e["tid"] == HOST]
    return {
        "trace": path, **run_ahead(blocks, waits),
        "compute_ms": dict(phases), "compute_busy_ms": busy(compute),
        "allgather_ms": busy(tracks[ALL_GATHER]), "allgather_beside_compute_ms": beside(tracks[ALL_GATHER], compute),
        "reduce_scatter_ms": busy(tracks[REDUCE_SCATTER]),
        "reduce_scatter_beside_compute_ms": beside(tracks[REDUCE_SCATTER], compute),
    }


def encloses(event, events):
    """Whether a compute span holds another compute span (the root's do)."""
    start, end = event["ts"], event["ts"] + event["dur"]
    return any(o is not event and o["tid"] == COMPUTE and start <= o["ts"] and o["ts"] + o["dur"] <= end
               for o in events)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--json", help="write the summaries here too")
    args = parser.parse_args()
    summaries = [summarise(path) for path in args.traces]
    for s in summaries:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in sorted(s["compute_ms"].items()))
        print(f"{s['trace']}: blocks' compute {s['compute_busy_ms']:.1f} ms ({phases}); all-gathers "
              f"{s['allgather_ms']:.1f} ms ({s['allgather_beside_compute_ms']:.1f} beside compute), reduce-scatters "
              f"{s['reduce_scatter_ms']:.1f} ms ({s['reduce_scatter_beside_compute_ms']:.1f} beside)")
        waits = "; ".join(f"{w['times']} waits on the {cap} cap, {w['ms']:.1f} ms" for cap, w in s["cap_waits"].items())
        print(f"    the CPU ahead of the GPU: median {s['lead_ms_median']:.1f} ms (max {s['lead_ms_max']:.1f}), "
              f"median {s['groups_ahead_median']} groups issued not yet started (max {s['groups_ahead_max']}); "
              f"{waits or 'no waits on the caps'}")
    if args.json:
        json.dump(summaries, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
