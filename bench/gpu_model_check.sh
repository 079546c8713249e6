#!/usr/bin/env bash
# One device call on 2 GPUs (about 7 minutes, at most 9) for the model's kernels (issue #12): build, the
# 2-rank GPU suite (fused kernels against ATen, parity) and a 2-GPU training run, the SDPA
# backends at the benchmark's shapes, then run_bench.py on 1b (vs FSDP2 eager and compiled) and
# small (vs FSDP2 eager and DDP). Every phase has its own time limit, so a slow one cannot take
# the others' results with it; everything lands in one tar under OUT.
#   bash bench/gpu_model_check.sh OUT COMMIT [STEPS]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}; commit=${2:-unknown}; steps=${3:-10}
source bench/gpu_env.sh
work=/tmp/fsdp-model-check
rm -rf "$work" && mkdir -p "$work" "$out"
# Packs what exists so far (after every phase: a call cut off at its limit still returns the rest).
pack() {
  gzip -f "$work"/*/profile-*-rank0.json 2>/dev/null
  rm -f "$out"/model-check.tgz.part*
  tar czf - -C /tmp --exclude='init-*.pt' --exclude='profile-*-rank[1-9]*' fsdp-model-check \
    | split -b 15M -d - "$out/model-check.tgz.part"
}
record_env "$work/env.txt" "$commit"
phase() {  # phase NAME SECONDS COMMAND...: runs COMMAND under a time limit into NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" > "$work/$name.log" 2>&1
  local status=$?
  pkill -f build/fsdp-train; pkill -f bench/fsdp2_llama.py  # what a cut-off phase left running
  echo "$name: exit $status after $((SECONDS - start)) s" | tee -a "$work/phases.txt"
  tail -4 "$work/$name.log"
  pack
  return $status
}
phase build 240 env FSDP_JOBS="$(nproc)" bash scripts/setup.sh || exit 1
phase gpu-tests 100 ctest --test-dir build -R '^(gpu_2_ranks|train_gpu_2|train_gpu_2_checkpoint)$' --output-on-failure
phase sdpa 30 python3 bench/sdpa_backends.py
phase bench-1b 180 python3 bench/run_bench.py --out "$work/bench-1b" --commit "$commit" --configs 1b --steps "$steps"
phase bench-small 90 python3 bench/run_bench.py --out "$work/bench-small" --commit "$commit" --configs small \
  --steps "$steps" --systems pytorch-fsdp2,pytorch-ddp
