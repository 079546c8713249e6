"""Where reserved-but-unallocated GPU memory sits at the allocation peak, from a
CUDA caching-allocator snapshot (fsdp-train --memory-snapshot, or PyTorch's
torch.cuda.memory._dump_snapshot) recorded with its allocation history.

    python3 bench/snapshot_holes.py SNAPSHOT.pickle[.gz] [--step N] [--min-mib 8] [--top 12] [--explain K]

Replays the trace of device 0 to the moment the most memory was allocated
(within step N when the snapshot has ProfilerStep#N markers, as fsdp-train's
do), then lists the free ranges between live blocks inside each segment, the
largest first, with the blocks on either side: their size and the step that
allocated them ("before" = allocated before recording started). A free range
smaller than a later large request cannot serve it, so the segment grows;
long-lived blocks allocated mid-step are the usual cause. --explain K lists, for the K
largest ranges, the blocks that used the range in the peak's step and were freed before the
peak (their sizes in allocation order): the temporaries whose space the live blocks around them
strand. --origins K sums the blocks live at the peak by where they were allocated (the innermost
Python frame outside torch, recorded with stacks="python") and lists the K largest sums.
"""
import argparse
import gzip
import pickle

MIB = 1 << 20


def load(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        return pickle.load(f)


def step_starts(snapshot):
    """[(time_us, step number)] of the ProfilerStep#N markers, in time order."""
    marks = [(a["time_us"], int(a["name"].split("#")[1])) for a in snapshot.get("external_annotations", [])
             if a.get("stage") == "START" and a.get("name", "").startswith("ProfilerStep#")]
    return sorted(marks)


def step_at(marks, time_us):
    step = 0
    for start, number in marks:
        if start <= time_us:
            step = number
    return step


def live_at_peak(snapshot, step=None, device=0):
    """(allocated bytes, {address: (size, event index or None)}, the peak's event index) at the
    peak, the trace and the step markers."""
    trace = snapshot["device_traces"][device]
    marks = step_starts(snapshot)
    seen, initial = set(), {}
    for e in trace:  # blocks alive when recording started: freed before any alloc at their address
        if e["action"] in ("alloc", "free_completed") and e["addr"] not in seen:
            seen.add(e["addr"])
            if e["action"] == "free_completed":
                initial[e["addr"]] = (e["size"], None)
    for seg in snapshot["segments"]:
        if seg["device"] == device:
            for b in seg["blocks"]:
                if b["state"] == "active_allocated" and b["address"] not in seen:
                    initial[b["address"]] = (b["size"], None)
    live = dict(initial)
    allocated = sum(size for size, _ in live.values())
    best = (allocated, dict(live), -1)
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], i)
            allocated += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            allocated -= live.pop(e["addr"])[0]
        else:
            continue
        if allocated > best[0] and (step is None or step_at(marks, e["time_us"]) == step):
            best = (allocated, dict(live), i)
    return best[0], best[1], best[2], trace, marks


def holes(snapshot, live, device=0):
    """[(size, segment, start address, block before, block after)] of the free ranges."""
    out = []
    for seg in snapshot["segments"]:
        if seg["device"] != device:
            continue
        start, end = seg["address"], seg["address"] + seg["total_size"]
        blocks = sorted((a, size, i) for a, (size, i) in live.items() if start <= a < end)
        position, previous = start, None
        for block in blocks + [(end, 0, None)]:
            if block[0] > position:
                out.append((block[0] - position, seg, position, previous, block if block[1] else None))
            position, previous = max(position, block[0] + block[1]), block
    return sorted(out, key=lambda h: -h[0])


def describe(block, trace, marks):
    if block is None:
        return "segment end"
    _, size, event = block
    when = "before" if event is None else f"step {step_at(marks, trace[event]['time_us'])}"
    return f"{size / MIB:.0f} MiB ({when})"


def temporaries(trace, marks, peak, start, size):
    """Sizes of the blocks inside [start, start + size) allocated in the peak's step and freed
    before the peak, in allocation order."""
    step = step_at(marks, trace[peak]["time_us"])
    allocated, out = {}, []
    for e in trace[:peak + 1]:
        if step_at(marks, e["time_us"]) != step or not start <= e["addr"] < start + size:
            continue
        if e["action"] == "alloc":
            allocated[e["addr"]] = len(out)
            out.append([e["size"], False])
        elif e["action"] == "free_completed" and e["addr"] in allocated:
            out[allocated.pop(e["addr"])][1] = True
    return [s for s, freed in out if freed]


def origin(event):
    """file:line function of the innermost recorded frame outside torch's own code."""
    for frame in event.get("frames", []):
        if "/torch/" not in frame["filename"]:
            return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
    return "no frame outside torch"


def origins(live, trace):
    """[(bytes, blocks, origin)] of the live blocks, largest sum first."""
    sums = {}
    for size, event in live.values():
        where = "allocated before recording" if event is None else origin(trace[event])
        total, count = sums.get(where, (0, 0))
        sums[where] = (total + size, count + 1)
    return sorted(((b, n, w) for w, (b, n) in sums.items()), reverse=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot")
    p.add_argument("--step", type=int, help="look for the peak within this step (ProfilerStep#N)")
    p.add_argument("--min-mib", type=float, default=8, help="list free ranges at least this large")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--explain", type=int, default=0, help="the freed blocks inside the K largest ranges")
    p.add_argument("--origins", type=int, default=0, help="the K largest sums of live blocks by where allocated")
    args = p.parse_args()
    snapshot = load(args.snapshot)
    allocated, live, peak, trace, marks = live_at_peak(snapshot, args.step)
    reserved = sum(s["total_size"] for s in snapshot["segments"] if s["device"] == 0)
    free = holes(snapshot, live)
    listed = [h for h in free if h[0] >= args.min_mib * MIB]
    print(f"{args.snapshot}: peak allocated {allocated / MIB:,.0f} MiB"
          + (f" in step {args.step}" if args.step is not None else "")
          + f"; segments {reserved / MIB:,.0f} MiB; free between and after live blocks "
          f"{sum(h[0] for h in free) / MIB:,.0f} MiB, {sum(h[0] for h in listed) / MIB:,.0f} MiB of it "
          f"in {len(listed)} ranges of at least {args.min_mib:g} MiB")
    for size, seg, start, before, after in listed[:args.top]:
        print(f"  {size / MIB:8.0f} MiB at +{(start - seg['address']) / MIB:,.0f} MiB of a "
              f"{seg['total_size'] / MIB:,.0f} MiB {seg['segment_type']} segment: after "
              f"{describe(before, trace, marks) if before else 'segment start'}, before "
              f"{describe(after, trace, marks)}")
    for size, seg, start, _, _ in listed[:args.explain]:
        sizes = temporaries(trace, marks, peak, start, size)
        print(f"  the {size / MIB:.0f} MiB range at +{(start - seg['address']) / MIB:,.0f} MiB held, in the peak's step: "
              + (", ".join(f"{s / MIB:.1f}" for s in sizes) + " MiB" if sizes else "nothing freed before the peak"))
    for total, count, where in origins(live, trace)[:args.origins]:
        print(f"  live at the peak: {total / MIB:8.0f} MiB in {count} blocks from {where}")


if __name__ == "__main__":
    main()
