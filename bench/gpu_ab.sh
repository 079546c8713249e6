#!/usr/bin/env bash
# A/B of the step time between this checkout's build and another commit's sources (a change's
# "step time unchanged" check), in one device call: builds BASE_SRC's program alone with this
# build's torch and nlohmann/json, then alternates RUNS runs of each, 30 steps, and prints each
# run's median step (steps 6-30) and the medians of both, with each side's peak allocated and
# reserved memory (the largest over its runs: of every step, and of steps 6-30).
#   AB_FRONT_END: trainer (default: fsdp-train) or python (bench/fsdp2_llama.py sharded by each
#     side's fsdpcpp package: the script the same, the package and library the side's own)
#   AB_MODEL: the model and its shape, flags both programs take (default "--model 1b --seq 2048 --batch 4")
#   AB_GPUS: how many GPUs (default 1)
#   AB_BASE_ENV: environment assignments for the base side's runs alone (an allocator setting,
#     say: "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,roundup_power2_divisions:4")
#   AB_NEW_FLAGS: flags the new side's runs alone take (a flag's A/B on one build: "--keep-compute-shards")
#   git archive BASE | tar -x -C build/ab-base     # here; carry build/ab-base to the device
#     (or HEAD, then git apply --directory=build/ab-base one of bench/variants/: a variant)
#   bash bench/gpu_ab.sh OUT_DIR build/ab-base [RUNS]
#   AB_BASE_ENV=... bash bench/gpu_ab.sh OUT_DIR . [RUNS]   # BASE_SRC '.': this build on both sides
#   AB_NEW_FLAGS=... bash bench/gpu_ab.sh OUT_DIR . [RUNS]  # the same
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder} base=${2:?base sources} runs=${3:-3}
model=${AB_MODEL:---model 1b --seq 2048 --batch 4} gpus=${AB_GPUS:-1} front_end=${AB_FRONT_END:-trainer}
read -r -a base_env <<< "${AB_BASE_ENV:-}"
read -r -a new_flags <<< "${AB_NEW_FLAGS:-}"
if [ "$base" = . ] && [ ${#base_env[@]} -eq 0 ] && [ ${#new_flags[@]} -eq 0 ]; then
  echo "gpu_ab.sh: BASE_SRC '.' runs this build on both sides: set AB_BASE_ENV or AB_NEW_FLAGS to what differs"; exit 2
fi
case $front_end in
  trainer) target=fsdp-train python=OFF ;;
  python) target=fsdpcpp_C python=ON ;;
  *) echo "gpu_ab.sh: AB_FRONT_END is '$front_end'; it must be trainer or python"; exit 2 ;;
esac
mkdir -p "$out"
source bench/gpu_env.sh
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
json=$(sed -n 's/^JSON_INCLUDE_DIR:PATH=//p' build/CMakeCache.txt)
if [ "$base" != . ]; then
  cmake -G Ninja -S "$base" -B "$base/build" -DCMAKE_PREFIX_PATH="$torch_prefix" -DFSDP_JSON_INCLUDE="$json" \
    -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_PYTHON=$python -DFSDP_PYTHON="$(command -v python3)" > "$out/ab-base-build.log" 2>&1 &&
    cmake --build "$base/build" --target $target >> "$out/ab-base-build.log" 2>&1 || { tail -20 "$out/ab-base-build.log"; exit 1; }
fi
for i in $(seq "$runs"); do
  for side in new base; do
    tree=. side_env=() side_flags=("${new_flags[@]}")
    [ "$side" = base ] && tree=$base side_env=("${base_env[@]}") side_flags=()
    if [ "$front_end" = trainer ]; then
      # The base may predate --overwrite-log: a rerun into OUT removes its own log first.
      rm -f "$out/ab-$side-$i.jsonl"
      env "${side_env[@]}" build/fsdp-run --gpu -n "$gpus" "$tree/build/fsdp-train" $model "${side_flags[@]}" --param-dtype bf16 --steps 30 \
        --log "$out/ab-$side-$i.jsonl" > "$out/ab-$side-$i.log" 2>&1
    else
      env "${side_env[@]}" PYTHONPATH="$tree/build/py" python3 -m torch.distributed.run --standalone --nproc-per-node="$gpus" \
        bench/fsdp2_llama.py --runtime fsdpcpp $model "${side_flags[@]}" --steps 30 --jsonl "$out/ab-$side-$i.jsonl" > "$out/ab-$side-$i.log" 2>&1
    fi || { tail -5 "$out/ab-$side-$i.log"; exit 1; }
  done
done
python3 - "$out" "$runs" "$front_end $model" "$gpus" <<'PY'
import statistics, sys
sys.path.insert(0, "bench")
import step_log
out, runs, model, gpus = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
for side in ("new", "base"):
    logs = [step_log.read(f"{out}/ab-{side}-{i}.jsonl") for i in range(1, runs + 1)]
    each = [step_log.median_step_ms(log, 5) for log in logs]
    # The largest over the runs, of every step, or of the steps after warm-up (the median's).
    peak = lambda key, first: max(r[key] for log in logs for r in log[first:])
    alloc, reserved = peak("peak_alloc_gib", 0), peak("peak_reserved_gib", 0)
    later_alloc, later_reserved = peak("peak_alloc_gib", 5), peak("peak_reserved_gib", 5)
    print(f"{model} on {gpus} GPU(s), {side}: median step {statistics.median(each):.1f} ms ({', '.join(f'{m:.1f}' for m in each)}), "
          f"peak allocated / reserved {alloc:.2f} / {reserved:.2f} GiB ({reserved / alloc:.3f}), "
          f"after warm-up {later_alloc:.2f} / {later_reserved:.2f} GiB ({later_reserved / later_alloc:.3f})")
PY
