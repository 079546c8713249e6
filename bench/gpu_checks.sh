#!/usr/bin/env bash
# On a GPU machine: builds and runs the whole test suite (the GPU tests are
# registered there), writing logs to OUT_DIR. bench/run_bench.py measures.
#   bash bench/gpu_checks.sh OUT_DIR COMMIT
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
commit=${2:-unknown}
mkdir -p "$out"
source bench/gpu_env.sh
export FSDP_JOBS=${FSDP_JOBS:-16}
record_env "$out/env.txt" "$commit"
cat "$out/env.txt"
bash scripts/test.sh 2>&1 | tee "$out/tests.log"
