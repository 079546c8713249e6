#!/usr/bin/env python3
"""Checks an fsdp-train JSONL log (ctest and the GPU runs use it).

  check_train_log.py LOG --steps N [--loss-falls] [--gpu-memory] [--stable-from S --rss-growth-mib M
                     [--step-time-drift F]]

--loss-falls      the mean loss of the last 3 steps is at least 5% below that of the first 3
--gpu-memory      every step has positive peak allocated and reserved GPU memory
--same-loss-as OTHER --loss-tolerance T
                  every step in both logs has the same loss within relative T (0: exactly), and the
                  same gradient norm and held-out loss where both logs have them
--stable-from S   from step S on: the exact bytes allocated at the end of every step equal those
                  at step S, reserved bytes never change, host RSS grows by less than M MiB, and
                  (only with --step-time-drift F, for benchmark runs on a dedicated machine, never
                  in ctest: a shared CI machine's step time swings by more than any bound) the
                  median step time of the last tenth of the run is within F (a fraction) of the
                  median over the tenth after step S
Prints one line per check and exits 1 on the first failure.
"""
import argparse
import json
import statistics
import sys


def fail(message):
    print(f"check_train_log: FAIL: {message}")
    sys.exit(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--loss-falls", action="store_true")
    p.add_argument("--gpu-memory", action="store_true")
    p.add_argument("--same-loss-as")
    p.add_argument("--loss-tolerance", type=float, default=0.0)
    p.add_argument("--first-step", type=int, default=1, help="the log starts here (a resumed run)")
    p.add_argument("--stable-from", type=int)
    p.add_argument("--rss-growth-mib", type=float, default=50)
    p.add_argument("--step-time-drift", type=float)
    a = p.parse_args()
    with open(a.log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if [r["step"] for r in rows] != list(range(a.first_step, a.steps + 1)):
        fail(f"{a.log}: expected steps {a.first_step}..{a.steps}, found {len(rows)} rows")
    print(f"check_train_log: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")

    if a.loss_falls:
        first = statistics.mean(r["loss"] for r in rows[:3])
        last = statistics.mean(r["loss"] for r in rows[-3:])
        if not last < 0.95 * first:
            fail(f"loss did not fall: first 3 steps {first:.4f}, last 3 {last:.4f}")
        print(f"check_train_log: loss falls {first:.4f} -> {last:.4f}: ok")

    if a.same_loss_as:
        with open(a.same_loss_as) as f:
            other = {r["step"]: r for r in map(json.loads, filter(str.strip, f)) if "step" in r}
        worst = 0.0
        for r in rows:
            if r["step"] not in other:
                fail(f"step {r['step']} is not in {a.same_loss_as}")
            theirs = other[r["step"]]
            for key in ("loss", "grad_norm", "eval_loss"):
                if r.get(key) is None or theirs.get(key) is None:
                    continue
                diff = abs(r[key] - theirs[key]) / abs(theirs[key])
                worst = max(worst, diff)
                if diff > a.loss_tolerance:
                    fail(f"step {r['step']}: {key} {r[key]} vs {theirs[key]} in {a.same_loss_as}, "
                         f"relative difference {diff:.3g} over {a.loss_tolerance}")
        print(f"check_train_log: losses (and gradient norms, held-out losses) as in {a.same_loss_as}, "
              f"largest relative difference {worst:.3g}: ok")

    if a.gpu_memory:
        for r in rows:
            if not (r["peak_alloc_gib"] > 0 and r["peak_reserved_gib"] > 0 and r["alloc_end_bytes"] > 0):
                fail(f"step {r['step']}: GPU memory fields missing or zero: {r}")
        print(f"check_train_log: GPU memory on every step, last peak {rows[-1]['peak_alloc_gib']:.3f} GiB "
              f"allocated / {rows[-1]['peak_reserved_gib']:.3f} reserved: ok")

    if a.stable_from:
        base = rows[a.stable_from - 1]
        later = rows[a.stable_from - 1:]
        for r in later:
            if r["alloc_end_bytes"] != base["alloc_end_bytes"]:
                fail(f"allocated bytes at the end of step {r['step']}: {r['alloc_end_bytes']}, "
                     f"at step {a.stable_from}: {base['alloc_end_bytes']}")
            if r["reserved_end_bytes"] != base["reserved_end_bytes"]:
                fail(f"reserved bytes changed at step {r['step']}: {r['reserved_end_bytes']} vs "
                     f"{base['reserved_end_bytes']}")
        growth_mib = (max(r["rss_gib"] for r in later) - base["rss_gib"]) * 1024
        if growth_mib >= a.rss_growth_mib:
            fail(f"host RSS grew by {growth_mib:.1f} MiB after step {a.stable_from} "
                 f"(bound {a.rss_growth_mib} MiB)")
        print(f"check_train_log: steps {a.stable_from}..{a.steps}: allocated {base['alloc_end_bytes']} B and "
              f"reserved {base['reserved_end_bytes']} B at every step end, RSS +{growth_mib:.1f} MiB: ok")
        if a.step_time_drift is not None:
            tenth = max(1, len(later) // 10)
            early = statistics.median(r["step_ms"] for r in later[:tenth])
            late = statistics.median(r["step_ms"] for r in later[-tenth:])
            if abs(late / early - 1) > a.step_time_drift:
                fail(f"step time drifted: median {early:.2f} ms after step {a.stable_from}, {late:.2f} ms at the end")
            print(f"check_train_log: step time {early:.2f} -> {late:.2f} ms: ok")
    print("check_train_log: ok")


if __name__ == "__main__":
    main()
