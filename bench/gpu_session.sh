#!/usr/bin/env bash
# One lease on a GPU machine, in phases that each fit one device call (10 min):
#   bash bench/gpu_session.sh bench OUT COMMIT [CONFIGS] [REPEATS]  build, GPU tests, run_bench.py
#   bash bench/gpu_session.sh memreport OUT COMMIT        memreport.py (build kept from 'bench')
# Writes one tar per phase under OUT (in 15 MiB parts); weights and all but rank 0's profiles
# stay on the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase}; out=${2:?output folder}; commit=${3:-unknown}
source bench/gpu_env.sh
work=/tmp/fsdp-$phase
rm -rf "$work" && mkdir -p "$work" "$out"
case $phase in
  bench)
    # setup.sh also finds (or installs from .whl/) the nlohmann/json headers the build needs.
    FSDP_JOBS=$(nproc) bash scripts/setup.sh > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
    (cd build && ctest -R 'gpu|train' --output-on-failure) > "$work/gpu-tests.log" 2>&1
    ok=$?; tail -8 "$work/gpu-tests.log"
    [ $ok -eq 0 ] || { tar czf "$out/bench.tgz.part00" -C /tmp "fsdp-$phase"; exit 1; }
    python3 bench/run_bench.py --out "$work" --commit "$commit" --configs "${4:-1b,1b-ac,small,1b-lowlr}" \
      --repeats "${5:-1}" > "$work/run_bench.log" 2>&1
    ok=$?; tail -40 "$work/run_bench.log"
    # The allocator's history of a checkpointed 1B run (where reserved/allocated is highest).
    build/fsdp-run --gpu build/fsdp-train --model 1b --seq 2048 --batch 4 --steps 4 --param-dtype bf16 \
      --recompute --memory-snapshot "$work/snapshot-1b-ac" --log "$work/snapshot-1b-ac.jsonl" \
      > "$work/snapshot-1b-ac.log" 2>&1 || tail -5 "$work/snapshot-1b-ac.log"
    python3 bench/snapshot_holes.py "$work/snapshot-1b-ac-rank0.pickle" --step 3 | tee -a "$work/snapshot-1b-ac.log"
    rm -f "$work"/snapshot-*-rank[1-9]*.pickle; gzip -f "$work"/snapshot-*.pickle 2>/dev/null ;;
  memreport)
    python3 bench/memreport.py --out "$work" --commit "$commit" > "$work/memreport.log" 2>&1
    ok=$?; tail -14 "$work/memreport.log" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
rm -f "$work"/init-*.pt "$work"/profile-*-rank[1-9]*.json
gzip -f "$work"/profile-*.json 2>/dev/null
# The device returns files of at most 16 MiB: parts to join with `cat phase.tgz.part* | tar xz`.
tar czf - -C /tmp "fsdp-$phase" | split -b 15M -d - "$out/$phase.tgz.part"
exit $ok
