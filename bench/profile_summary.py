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
  kinds            kernel time summed by kind (matrix products, attention, communication, the
                   optimizer, copies and casts, norms, the rest): where the step's GPU time goes
--gaps N lists each step's N longest idle gaps: where in the step, the kernels either side, and
the innermost CPU op running as the gap began (what the host was doing while the GPU waited).
--exposed N lists each step's N longest stretches of exposed communication the same way, with
the collective's kernel: which all-gather or reduce-scatter the step waited for, and where.
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


# Kinds of kernel, tried in order: the first whose words one appears in the lower-cased name.
KINDS = [("communication", ("nccl",)),
         ("attention", ("flash", "sdpa", "fmha", "attention")),
         ("optimizer", ("adam",)),
         ("matrix products", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
         ("copies and casts", ("copy", "chunk_cat", "catarray", "split_with_sizes", "memcpy", "memset")),
         ("norms", ("norm",))]
OTHER = "elementwise and other"


def kind(name):
    lower = name.lower()
    return next((k for k, words in KINDS if any(w in lower for w in words)), OTHER)


def short_name(name, width):
    """The kernel's name less ATen's namespace noise, which would fill the width before the functor."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::"):
        name = name.replace(noise, "")
    return name[:width]


def idle_gaps(busy, lo, hi):
    """The stretches of [lo, hi) that no interval of `busy` (merged, sorted) covers."""
    gaps, at = [], lo
    for start, end in busy:
        if start > at:
            gaps.append((at, min(start, hi)))
        at = max(at, end)
    if at < hi:
        gaps.append((at, hi))
    return [g for g in gaps if g[1] > g[0]]


def difference(a, b):
    """The stretches of merged intervals `a` that merged intervals `b` do not cover."""
    return [gap for start, end in a for gap in idle_gaps([iv for iv in b if iv[1] > start and iv[0] < end], start, end)]


def describe_gap(gap, lo, inside, cpu_ops, width):
    """Where the stretch `gap` lies in the step starting at `lo`, the kernels of `inside` either
    side of it and the innermost CPU op running as it began."""
    start, end = gap
    before = max((e for e in inside if e["ts"] + e["dur"] <= start), key=lambda e: e["ts"] + e["dur"], default=None)
    after = min((e for e in inside if e["ts"] >= end), key=lambda e: e["ts"], default=None)
    running = [e for e in cpu_ops if e["ts"] <= start < e["ts"] + e["dur"]]
    host = min(running, key=lambda e: e["dur"], default=None)
    return dict(at_ms=(start - lo) / 1e3, ms=(end - start) / 1e3,
                before=short_name(before["name"], width) if before else "",
                after=short_name(after["name"], width) if after else "",
                host=short_name(host["name"], width) if host else "")


def summarize(path, top=15, width=90, gaps=0, exposed=0):
    events = json.load((gzip.open if path.endswith(".gz") else open)(path, "rt"))["traceEvents"]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"])
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
               and not e.get("name", "").startswith("ProfilerStep#")] if gaps or exposed else []
    rows, totals, step_gaps, step_exposed = [], collections.defaultdict(lambda: [0, 0.0]), [], []
    kinds = collections.defaultdict(float)
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in gpu if lo <= e["ts"] < hi]
        clip = lambda e: (e["ts"], min(e["ts"] + e["dur"], hi))
        comm = union(clip(e) for e in inside if is_nccl(e["name"]))
        compute = union(clip(e) for e in inside if not is_nccl(e["name"]))
        merged = union([*comm, *compute])
        busy = length(merged)
        if gaps:
            longest = sorted(idle_gaps(merged, lo, hi), key=lambda g: g[0] - g[1])[:gaps]
            step_gaps.append([describe_gap(g, lo, inside, cpu_ops, width) for g in longest])
        if exposed:
            longest = sorted(difference(comm, compute), key=lambda g: g[0] - g[1])[:exposed]
            computing = [e for e in inside if not is_nccl(e["name"])]
            step_exposed.append([
                dict(describe_gap(g, lo, computing, cpu_ops, width),
                     collective=next((short_name(e["name"], width) for e in inside if is_nccl(e["name"])
                                      and e["ts"] <= g[0] < e["ts"] + e["dur"]), ""))
                for g in longest])
        rows.append(dict(step_ms=step["dur"] / 1e3, compute_ms=length(compute) / 1e3,
                         nccl_ms=length(comm) / 1e3,
                         exposed_comm_ms=(length(comm) - length(intersection(comm, compute))) / 1e3,
                         idle_ms=(step["dur"] - busy) / 1e3, kernels=len(inside)))
        for e in inside:
            totals[e["name"]][0] += 1
            totals[e["name"]][1] += e["dur"] / 1e3
            kinds[kind(e["name"])] += e["dur"] / 1e3
    if not rows:
        return None
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary["steps"] = len(rows)
    summary["gaps"] = step_gaps
    summary["exposed"] = step_exposed
    summary["kinds"] = {k: ms / len(rows) for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1])}
    summary["top_kernels"] = [
        dict(name=short_name(name, width), calls=n / len(rows), ms=ms / len(rows))
        for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]]
    return summary


def main():
    p = argparse.ArgumentParser()
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--name-width", type=int, default=90, help="characters of each kernel's name shown")
    p.add_argument("--gaps", type=int, default=0, help="list each step's N longest idle gaps")
    p.add_argument("--exposed", type=int, default=0,
                   help="list each step's N longest stretches of exposed communication")
    args = p.parse_args()
    for path in args.traces:
        s = summarize(path, args.top, args.name_width, args.gaps, args.exposed)
        if s is None:
            print(f"{path}: no ProfilerStep spans")
            continue
        print(f"{path}: median of {s['steps']} steps: step {s['step_ms']:.1f} ms | compute "
              f"{s['compute_ms']:.1f} | nccl {s['nccl_ms']:.1f} | exposed comm {s['exposed_comm_ms']:.1f} | "
              f"idle {s['idle_ms']:.1f} | {s['kernels']:.0f} kernels")
        print("    by kind: " + " | ".join(f"{k} {ms:.1f}" for k, ms in s["kinds"].items()))
        for k in s["top_kernels"]:
            print(f"    {k['ms']:8.2f} ms {k['calls']:6.0f}x  {k['name']}")
        for step, gaps in enumerate(s["gaps"]):
            print(f"  idle gaps of profiled step {step + 1}, longest first:")
            for g in gaps:
                print(f"    {g['ms']:7.2f} ms at {g['at_ms']:7.2f} ms | after {g['before'] or '(step start)'} | "
                      f"before {g['after'] or '(step end)'} | host in {g['host'] or '(nothing traced)'}")
        for step, stretches in enumerate(s["exposed"]):
            print(f"  exposed communication of profiled step {step + 1}, longest first:")
            for g in stretches:
                print(f"    {g['ms']:7.2f} ms at {g['at_ms']:7.2f} ms | {g['collective']} | after {g['before'] or '(step start)'} "
                      f"| before {g['after'] or '(step end)'} | host in {g['host'] or '(nothing traced)'}")


if __name__ == "__main__":
    main()
