"""Checks trace_overlap's run-ahead arithmetic on a hand-made trace (ctest)."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import trace_overlap  # noqa: E402


def span(name, tid, ts, dur, issued):
    return dict(ph="X", name=name, pid=0, tid=tid, ts=ts, dur=dur, args=dict(issued_us=issued))


# The root's forward encloses four spans of three groups'. Issued at 0, 1, 2 and 20 us, they start
# on the device at 10, 12, 15 and 21: leads of 10, 11, 13 and 1 us. When B was issued, both of A's
# spans had not started: two spans, one group ahead. The host waited once on each cap.
trace = dict(traceEvents=[
    span("forward #9 Root", 0, 0, 100, 0),
    span("forward #1 A", 0, 10, 2, 0), span("backward #1 A", 0, 12, 3, 1), span("forward #2 B", 0, 15, 5, 2),
    span("forward #3 C", 0, 21, 5, 20),
    span("all-gather #2 B", 1, 5, 8, 1),
    span("wait: all-gather cap, for #2 B", 5, 1, 3, 1), span("wait: reduce-scatter cap, for #1 A", 5, 30, 2, 30),
    dict(ph="i", s="t", name="issue forward #1 A", pid=0, tid=5, ts=0)])
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(trace, f)
s = trace_overlap.summarise(f.name)
os.unlink(f.name)
assert abs(s["lead_ms_median"] - 0.0105) < 1e-12 and abs(s["lead_ms_max"] - 0.013) < 1e-12, s
assert s["groups_ahead_median"] == 0.5 and s["groups_ahead_max"] == 1, s
assert s["cap_waits"] == {"all-gather": {"times": 1, "ms": 0.003}, "reduce-scatter": {"times": 1, "ms": 0.002}}, s
assert abs(s["compute_busy_ms"] - 0.015) < 1e-12 and abs(s["allgather_beside_compute_ms"] - 0.003) < 1e-12, s
print("trace_overlap: ok")
