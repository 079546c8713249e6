#!/usr/bin/env bash
# The reliability GPU record, in two device calls of under 10 minutes each (the build stays between them):
#   bash bench/gpu_reliability.sh suite OUT COMMIT   build, the whole ctest suite (GPU tests, fsdp-train on
#                                                    1 and all GPUs, SIGTERM on GPUs)
#   bash bench/gpu_reliability.sh long OUT COMMIT [STEPS]
#                                                    STEPS (default 3000) of the small model on all GPUs with
#                                                    the memory log, checked for flat memory and step time
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase}; out=${2:?output folder}; commit=${3:-unknown}
source bench/gpu_env.sh
mkdir -p "$out"
record_env "$out/env-$phase.txt" "$commit"
case $phase in
  suite)
    build_and_test "$out" 60
    exit $? ;;
  long)
    steps=${4:-3000}
    build/fsdp-run --gpu build/fsdp-train --model small --seq 512 --batch 2 --steps "$steps" \
      --overwrite-log --log "$out/long-small.jsonl" --memory-log "$out/long-small-memory" > "$out/long-small.log" 2>&1
    ok=$?
    tail -3 "$out/long-small.log"
    [ $ok -eq 0 ] || exit $ok
    rm -f "$out"/long-small-memory-rank[1-9]*.jsonl
    python3 tests/trainer/check_train_log.py "$out/long-small.jsonl" --steps "$steps" --gpu-memory --stable-from 100 \
      --rss-growth-mib 50 --step-time-drift 0.10 | tee "$out/long-small-check.txt"
    exit "${PIPESTATUS[0]}" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
