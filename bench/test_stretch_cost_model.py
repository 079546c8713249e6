"""Checks bench/stretch_cost_model.py against a measurement (ctest stretch_cost_model):
bench/llama_slice.py writes the tiny model's shapes with 2 blocks and with all 8, fsdp-train
profiles each on 2 CPU ranks (--cost-model), the 2-block model is stretched to 8, and both are
projected to 2-64 GPUs. Every projected peak of the stretched model is the measured 8-block
model's to the byte (the blocks are alike, and so are their buffers); step times are not compared
(CPU ranks' times vary run to run). Refusals: fewer blocks than measured, an existing --out.

    python3 bench/test_stretch_cost_model.py BUILD_DIR
"""
import os
import re
import subprocess
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
BUILD = sys.argv[1]


def run(*cmd):
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def must(*cmd):
    rc, out = run(*cmd)
    assert rc == 0, f"{' '.join(cmd)} failed:\n{out[-3000:]}"
    return out


def peaks(report):
    """(GPUs, shape) -> 'peak a GPU' of an fsdp-train --project report."""
    rows = re.findall(r"^\s+(\d+)\s+(FSDP|HSDP \S+)\s+[\d.]+\s+[\d.]+\s+([\d.]+ \w+)$", report, re.M)
    assert rows, report
    return {(int(g), shape): peak for g, shape, peak in rows}


with tempfile.TemporaryDirectory() as work:
    projected = {}
    for blocks in (2, 8):
        model, cost = f"{work}/tiny-{blocks}", f"{work}/cost-{blocks}.json"
        must(sys.executable, f"{BENCH}/llama_slice.py", "--model", "tiny", "--layers", str(blocks), "--out", model)
        must(f"{BUILD}/fsdp-run", "-n", "2", "--cpu", f"{BUILD}/fsdp-train", "--init-from", model, "--seq", "32",
             "--batch", "2", "--steps", "5", "--memory-budget", "1", "--plan-only", "--cost-model", cost,
             "--log", f"{work}/plan-{blocks}.jsonl")
    stretched = f"{work}/cost-2-to-8.json"
    print(must(sys.executable, f"{BENCH}/stretch_cost_model.py", f"{work}/cost-2.json", "--blocks", "8",
               "--out", stretched).strip())
    for name, cost in (("measured", f"{work}/cost-8.json"), ("stretched", stretched)):
        projected[name] = peaks(must(f"{BUILD}/fsdp-train", "--project", cost, "--project-worlds", "2,8,64",
                                     "--gpus-per-host", "4", "--recompute"))
    assert projected["stretched"] == projected["measured"], projected
    print(f"stretch_cost_model: peaks {projected['stretched']} as the 8-block model's")

    rc, out = run(sys.executable, f"{BENCH}/stretch_cost_model.py", f"{work}/cost-8.json", "--blocks", "4",
                  "--out", f"{work}/fewer.json")
    assert rc != 0 and "fewer than the 8 measured" in out, out
    rc, out = run(sys.executable, f"{BENCH}/stretch_cost_model.py", f"{work}/cost-2.json", "--blocks", "8",
                  "--out", stretched)
    assert rc != 0 and "exists" in out, out
print("stretch_cost_model: ok")
