#!/usr/bin/env python3
"""Runs a command and ends it (its whole process group) before the host runs out of memory.

A run that needs more host memory than the machine has does not fail cleanly: the kernel's OOM
killer, or a machine that stops answering, takes the record with it. This guard polls the host's
MemAvailable and, once it falls below --min-available-gib, kills the command and says so, with the
most memory in use it saw and when. It writes one JSON line of the outcome to --out.

  python3 bench/host_memory_guard.py --min-available-gib 6 --out guard.json -- COMMAND...
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time


def meminfo_gib():
    """(total, available) host memory in GiB, from /proc/meminfo."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) / 2**20  # kB -> GiB
    return fields["MemTotal"], fields["MemAvailable"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-available-gib", type=float, default=6.0,
                   help="kill the command when the host's available memory falls below this")
    p.add_argument("--poll-s", type=float, default=0.2, help="seconds between readings")
    p.add_argument("--settle-s", type=float, default=120,
                   help="before starting, wait up to this long for the memory of an earlier run to come back")
    p.add_argument("--out", required=True, help="JSON line: outcome, peak GiB in use, seconds")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given (put it after --)")

    # A process killed just before may still be handing its (pinned) memory back.
    waited = time.monotonic()
    total, available = meminfo_gib()
    while available < args.min_available_gib + 1 and time.monotonic() - waited < args.settle_s:
        time.sleep(args.poll_s)
        total, available = meminfo_gib()
    if available < args.min_available_gib + 1:
        sys.exit(f"host_memory_guard: only {available:.1f} GiB available after {args.settle_s} s; not starting")
    baseline = total - available
    start = time.monotonic()
    child = subprocess.Popen(command, start_new_session=True)  # its own group: kill takes every rank
    peak, peak_at, killed = baseline, 0.0, False
    while child.poll() is None:
        total, available = meminfo_gib()
        if total - available > peak:
            peak, peak_at = total - available, time.monotonic() - start
        if available < args.min_available_gib:
            os.killpg(child.pid, signal.SIGKILL)
            killed = True
            child.wait()
            break
        time.sleep(args.poll_s)
    outcome = {
        "outcome": "killed: host memory" if killed else f"exit {child.returncode}",
        "peak_in_use_gib": round(peak, 2), "baseline_in_use_gib": round(baseline, 2),
        "host_total_gib": round(total, 2), "peak_at_s": round(peak_at, 1),
        "seconds": round(time.monotonic() - start, 1), "min_available_gib": args.min_available_gib,
        "command": command,
    }
    with open(args.out, "w") as f:
        f.write(json.dumps(outcome) + "\n")
    print(f"host_memory_guard: {outcome['outcome']} after {outcome['seconds']} s; at most "
          f"{outcome['peak_in_use_gib']} of {outcome['host_total_gib']} GiB in use (at {outcome['peak_at_s']} s)",
          flush=True)
    sys.exit(137 if killed else child.returncode)


if __name__ == "__main__":
    main()
