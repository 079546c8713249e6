#!/usr/bin/env bash
# One device call on 2 GPUs (about 8 minutes) for the model's kernels (issue #12): build, the
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
finish() {
  rm -f "$work"/*/init-*.pt "$work"/*/profile-*-rank[1-9]*.json
  gzip -f "$work"/*/profile-*.json 2>/dev/null
  tar czf - -C /tmp fsdp-model-check | split -b 15M -d - "$out/model-check.tgz.part"
}
trap finish EXIT
record_env "$work/env.txt" "$commit"
phase() {  # phase NAME SECONDS COMMAND...: runs COMMAND under a time limit into NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$work/phases.txt"
  tail -4 "$work/$name.log"
}
phase build 300 env FSDP_JOBS="$(nproc)" bash scripts/setup.sh || exit 1
phase gpu-tests 150 ctest --test-dir build -R '^(gpu_2_ranks|train_gpu_2)$' --output-on-failure
phase sdpa 40 python3 bench/sdpa_backends.py
phase bench-1b 240 python3 bench/run_bench.py --out "$work/bench-1b" --commit "$commit" --configs 1b --steps "$steps"
phase bench-small 150 python3 bench/run_bench.py --out "$work/bench-small" --commit "$commit" --configs small \
  --steps "$steps" --systems pytorch-fsdp2,pytorch-ddp
