"""Checks snapshot_holes' replay on a hand-made allocator snapshot (ctest)."""
import gzip
import os
import pickle
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import snapshot_holes  # noqa: E402

MIB = 1 << 20
BASE = 0x10000000


def event(action, offset_mib, size_mib, time_us, line=0):
    frames = [dict(filename="/x/torch/nn/linear.py", line=9, name="forward"),
              dict(filename="/repo/bench/model.py", line=line, name="block")]
    return dict(action=action, addr=BASE + offset_mib * MIB, size=size_mib * MIB, stream=0, time_us=time_us,
                frames=frames)


# A 100 MiB segment. Before recording: a block at +0 (kept) and one at +90 (freed in step 1).
# Step 1: a 20 MiB activation at +10 (freed) and a 5 MiB long-lived block at +30.
# Step 2: an 8 MiB temporary at +10 (freed), 50 MiB at +35, the peak (10 + 5 + 50 MiB), then freed.
snapshot = dict(
    segments=[dict(device=0, address=BASE, total_size=100 * MIB, segment_type="large", blocks=[
        dict(address=BASE, size=10 * MIB, state="active_allocated"),
        dict(address=BASE + 10 * MIB, size=20 * MIB, state="inactive"),
        dict(address=BASE + 30 * MIB, size=5 * MIB, state="active_allocated"),
        dict(address=BASE + 35 * MIB, size=65 * MIB, state="inactive")])],
    device_traces=[[event("alloc", 10, 20, 10), event("alloc", 30, 5, 11, line=7), event("free_completed", 90, 5, 12),
                    event("free_completed", 10, 20, 13), event("alloc", 10, 8, 16), event("free_completed", 10, 8, 17),
                    event("alloc", 35, 50, 20, line=8),
                    event("free_completed", 35, 50, 21)]],
    external_annotations=[dict(stage="START", name="ProfilerStep#1", time_us=0, device=0),
                          dict(stage="START", name="ProfilerStep#2", time_us=15, device=0)])

allocated, live, peak, trace, marks = snapshot_holes.live_at_peak(snapshot, step=2)
assert allocated == 65 * MIB, allocated
free = [(size // MIB, (start - BASE) // MIB) for size, _, start, _, _ in snapshot_holes.holes(snapshot, live)]
assert free == [(20, 10), (15, 85)], free
assert snapshot_holes.temporaries(trace, marks, peak, BASE + 10 * MIB, 20 * MIB) == [8 * MIB]  # not step 1's 20
assert snapshot_holes.origins(live, trace) == [(50 * MIB, 1, "model.py:8 block"), (10 * MIB, 1, "allocated before recording"),
                                               (5 * MIB, 1, "model.py:7 block")]
allocated_in_step_1, _, _, _, _ = snapshot_holes.live_at_peak(snapshot, step=1)
assert allocated_in_step_1 == 40 * MIB, allocated_in_step_1  # +0, +10, +30 and the pre-existing +90

with tempfile.NamedTemporaryFile(suffix=".pickle.gz", delete=False) as f:
    f.write(gzip.compress(pickle.dumps(snapshot)))
out = subprocess.run([sys.executable, snapshot_holes.__file__, f.name, "--step", "2", "--explain", "2", "--origins", "1"],
                     capture_output=True, text=True, check=True).stdout
os.unlink(f.name)
assert "peak allocated 65 MiB in step 2" in out, out
assert "20 MiB at +10 MiB of a 100 MiB large segment: after 10 MiB (before), before 5 MiB (step 1)" in out, out
assert "15 MiB at +85 MiB" in out and "before segment end" in out, out
assert "the 20 MiB range at +10 MiB held, in the peak's step: 8.0 MiB" in out, out
assert "the 15 MiB range at +85 MiB held, in the peak's step: nothing freed before the peak" in out, out
assert "live at the peak:       50 MiB in 1 blocks from model.py:8 block" in out, out
print("snapshot_holes: ok")
