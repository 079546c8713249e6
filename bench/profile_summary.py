"""Per-step GPU time from a PyTorch profiler (kineto) Chrome trace: how long
the GPU computed, communicated, did both at once, or sat idle.

    python3 bench/profile_summary.py TRACE.json[.gz] [TRACE.json ...] [--top 15]

Both fsdp-train --profile and bench/fsdp2_llama.py --profile write such
traces, with one "ProfilerStep#N" span per step; each step ends by waiting
for the GPU, so the GPU work of a step lies inside its span. Every NCCL
kernel counts as communication and every other kernel, copy or memset as
compute, whatever stream it ran on. Per step:
  compute_ms       time some compute kernel ran
  nccl_ms          time some NCCL kernel ran (includes waiting for the peer)
  exposed_comm_ms  time an NCCL kernel ran and no compute did: communication
                   the step waited for
  idle_ms          time nothing ran on the GPU (CPU-bound gaps)
"""
import argparse
import collections
import gzip
import json
import statistics


def union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(merged):
    return sum(end - start for start, end in merged)


def intersection(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def is_nccl(name):
    return "nccl" in name.lower()


def short_name(name, width):
    """The kernel's name less ATen's namespace noise, which would fill the width before the functor."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::"):
        name = name.replace(noise, "")
    return name[:width]


def summarize(path, top=15, width=90):
    events = json.load((gzip.open if path.endswith(".gz") else open)(path, "rt"))["traceEvents"]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"])
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    rows, totals = [], collections.defaultdict(lambda: [0, 0.0])
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in gpu if lo <= e["ts"] < hi]
        clip = lambda e: (e["ts"], min(e["ts"] + e["dur"], hi))
        comm = union(clip(e) for e in inside if is_nccl(e["name"]))
        compute = union(clip(e) for e in inside if not is_nccl(e["name"]))
        busy = length(union([*comm, *compute]))
        rows.append(dict(step_ms=step["dur"] / 1e3, compute_ms=length(compute) / 1e3,
                         nccl_ms=length(comm) / 1e3,
                         exposed_comm_ms=(length(comm) - length(intersection(comm, compute))) / 1e3,
                         idle_ms=(step["dur"] - busy) / 1e3, kernels=len(inside)))
        for e in inside:
            totals[e["name"]][0] += 1
            totals[e["name"]][1] += e["dur"] / 1e3
    if not rows:
        return None
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary["steps"] = len(rows)
    summary["top_kernels"] = [
        dict(name=short_name(name, width), calls=n / len(rows), ms=ms / len(rows))
        for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]]
    return summary


def main():
    p = argparse.ArgumentParser()
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--name-width", type=int, default=90, help="characters of each kernel's name shown")
    args = p.parse_args()
    for path in args.traces:
        s = summarize(path, args.top, args.name_width)
        if s is None:
            print(f"{path}: no ProfilerStep spans")
            continue
        print(f"{path}: median of {s['steps']} steps: step {s['step_ms']:.1f} ms | compute "
              f"{s['compute_ms']:.1f} | nccl {s['nccl_ms']:.1f} | exposed comm {s['exposed_comm_ms']:.1f} | "
              f"idle {s['idle_ms']:.1f} | {s['kernels']:.0f} kernels")
        for k in s["top_kernels"]:
            print(f"    {k['ms']:8.2f} ms {k['calls']:6.0f}x  {k['name']}")


if __name__ == "__main__":
    main()
