"""Checks host_memory_guard on real processes (ctest): an exit passes through, a run that takes
memory past the floor is killed with its process group, and a host already below it is refused."""
import json
import os
import subprocess
import sys
import tempfile
import time

GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_memory_guard.py")
sys.path.insert(0, os.path.dirname(GUARD))
from host_memory_guard import meminfo_gib  # noqa: E402


def guard(out, *args):
    result = subprocess.run([sys.executable, GUARD, "--out", out, *args], capture_output=True, text=True,
                            timeout=120)
    outcome = json.load(open(out)) if os.path.exists(out) else None
    return result.returncode, outcome, result.stdout + result.stderr


with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "guard.json")
    code, outcome, text = guard(out, "--min-available-gib", "0.5", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert code == 3 and outcome["outcome"] == "exit 3", (code, outcome, text)

    # A child that writes 3 GiB (and a grandchild that would outlive it) against a floor 1.5 GiB below
    # what is available now (the guard starts with 1 GiB above its floor): it kills both well before
    # either ends by itself.
    _, available = meminfo_gib()
    os.remove(out)
    pid_file = os.path.join(tmp, "grandchild.pid")
    grabber = ("import subprocess, sys, time\n"
               f"open('{pid_file}', 'w').write(str(subprocess.Popen(['sleep', '60']).pid))\n"
               "block = b'x' * (3 << 30)\n"
               "time.sleep(60)\n")
    code, outcome, text = guard(out, "--min-available-gib", f"{available - 1.5:.2f}", "--settle-s", "0",
                                "--", sys.executable, "-c", grabber)
    assert code == 137 and outcome["outcome"] == "killed: host memory", (code, outcome, text)
    assert outcome["seconds"] < 30 and outcome["peak_in_use_gib"] > outcome["baseline_in_use_gib"], outcome
    assert "killed: host memory" in text, text
    grandchild = int(open(pid_file).read())

    def alive(pid):  # a zombie (killed, not yet reaped by whoever adopted it) counts as dead
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    for _ in range(40):
        if not alive(grandchild):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the grandchild {grandchild} outlived the guard's kill")

    os.remove(out)
    code, outcome, text = guard(out, "--min-available-gib", "1e6", "--settle-s", "0", "--", "true")
    assert code != 0 and outcome is None and "not starting" in text, (code, outcome, text)
print("host_memory_guard: ok")
