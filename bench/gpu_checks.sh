#!/usr/bin/env bash
# On a GPU machine: the final check of a change, in two parts that each fit one device call (run
# `native` then `python` back to back while the machine is warm; `all` runs both). Each builds
# (incremental on a warm machine).
#   native: launcher_sigterm_gpu alone (it checks that no process is left on a GPU), the other GPU
#           tests one at a time, then the CPU tests six at a time (twelve on 60 cores or more;
#           GPU_CHECK_CPU_TESTS=0 leaves them to CI);
#           then fsdp-train's 1B on one GPU for 30 steps (its step time) and with a memory budget
#           (the planner's steps).
#   python: the Python package's GPU cases (python_gpu_tests_*, four parts side by side), then
#           the benchmark's Llama planned from Python (fsdpcpp.plan_memory_budget).
#   package: tests/tools/package_install.sh: a wheel from a fresh clone, installed into an empty
#           prefix, its fsdp-train on one GPU; then the same built without MPI (not part of `all`:
#           it builds everything twice more).
# Each run's step time, memory and losses must lie in bench/gpu_expected.json's ranges.
# Logs and JSON to OUT_DIR.
#   bash bench/gpu_checks.sh OUT_DIR COMMIT [all|native|python|package]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
commit=${2:-unknown}
part=${3:-all}
mkdir -p "$out"
source bench/gpu_env.sh
record_env "$out/env.txt" "$commit"
cat "$out/env.txt"
if [[ $part == package ]]; then
  bash tests/tools/package_install.sh python3 /tmp/fsdp-package > "$out/package-install.log" 2>&1
  status=$?
  FSDP_PACKAGE_WITHOUT_MPI=1 bash tests/tools/package_install.sh python3 /tmp/fsdp-package-no-mpi \
    > "$out/package-install-no-mpi.log" 2>&1 || status=1
  tail -n 3 "$out/package-install.log" "$out/package-install-no-mpi.log"
  exit $status
fi
build_with_log "$out/build-$part.log" || exit 1
status=0
if [[ $part != python ]]; then
  (cd build && ctest --output-on-failure -R launcher_sigterm_gpu) > "$out/gpu-tests-sigterm.log" 2>&1 || status=1
  (cd build && ctest --output-on-failure -R gpu -E "launcher_sigterm_gpu|python_gpu_tests") \
    > "$out/gpu-tests.log" 2>&1 || status=1
  # The CPU-only suites CI runs anyway (benchmark smoke tests, the README's commands, the Python
  # package on CPU ranks) are left to it: the device call has ten minutes. So is doc_links, which
  # checks the records' index against git's list of files: a device's copy of the tree may carry
  # an older .git than its files.
  # GPU_CHECK_CPU_TESTS=0 leaves them all to CI, where device time is short.
  if [[ ${GPU_CHECK_CPU_TESTS:-1} != 0 ]]; then
    other_jobs=$(( $(nproc) / 5 > 6 ? $(nproc) / 5 : 6 ))  # 6 on 16 cores (one GPU), 12 on 64 (four)
    (cd build && ctest --output-on-failure -j$other_jobs -E "gpu|bench_c|memreport_cpu|readme_commands|python_tests|doc_links") \
      > "$out/other-tests.log" 2>&1 || status=1
    grep -E "tests passed|\*\*\*Failed|Total Test" "$out/other-tests.log"
  fi
  grep -hE "Test +#|tests passed" "$out/gpu-tests-sigterm.log" "$out/gpu-tests.log"
  one_gpu=(build/fsdp-run --gpu -n 1 build/fsdp-train --model 1b --seq 2048 --batch 4 --param-dtype bf16)
  "${one_gpu[@]}" --steps 30 --overwrite-log --log "$out/train-1b.jsonl" > "$out/train-1b.log" 2>&1 || status=1
  "${one_gpu[@]}" --steps 10 --memory-budget 16 --overwrite-log --log "$out/budget-1b.jsonl" > "$out/budget-1b.log" 2>&1 || status=1
  grep -E "fsdp-train: plan for|predicted" "$out/budget-1b.log" | head -3
fi
if [[ $part != native ]]; then
  (cd build && ctest --output-on-failure -j4 -R python_gpu_tests) > "$out/gpu-tests-python.log" 2>&1 || status=1
  grep -hE "Test +#|tests passed" "$out/gpu-tests-python.log"
  # Planned from Python: the benchmark's own Llama sharded by fsdpcpp (its float32 logits and
  # PyTorch's AdamW need more than fsdp-train's 16 GiB: the smallest schedule peaks at 15.2 GiB).
  PYTHONPATH=build/py build/python -m torch.distributed.run --standalone --nproc-per-node=1 bench/fsdp2_llama.py \
    --runtime fsdpcpp --model 1b --seq 2048 --batch 4 --steps 10 --memory-budget 20 \
    --jsonl "$out/budget-1b-python.jsonl" > "$out/budget-1b-python.log" 2>&1 || status=1
  grep -E "fsdpcpp: plan for" "$out/budget-1b-python.log" | head -1
fi
# Each run against bench/gpu_expected.json's ranges (step time, memory, losses); the planned runs'
# peaks are their budgets' ceilings there.
python3 - "$out" "$part" <<'PY' || status=1
import json, sys
sys.path.insert(0, "bench")
import step_log
out, part = sys.argv[1], sys.argv[2]
expected = json.load(open("bench/gpu_expected.json"))
runs = {"native": ["train-1b", "budget-1b"], "python": ["budget-1b-python"]}
ok = True
for run in runs["native"] * (part != "python") + runs["python"] * (part != "native"):
    rows = step_log.read(f"{out}/{run}.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    measured = {"step_ms": step_log.median_step_ms(rows, 5), "peak_alloc_gib": max(r["peak_alloc_gib"] for r in rows),
                "peak_reserved_gib": max(r.get("peak_reserved_gib", 0) for r in rows),
                "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}
    for key, (low, high) in expected[run].items():
        value = measured[key]
        inside = value is not None and low <= value <= high
        ok &= inside
        print(f"{run}: {key} {value if value is None else round(value, 4)} "
              f"{'within' if inside else 'OUTSIDE'} [{low}, {high}]")
sys.exit(0 if ok else 1)
PY
exit $status
