#!/usr/bin/env bash
# On a GPU machine: builds and runs the whole test suite (the GPU tests are
# registered there), writing logs to OUT_DIR. bench/run_bench.py measures.
#   bash bench/gpu_checks.sh OUT_DIR COMMIT
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
commit=${2:-unknown}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FSDP_JOBS=${FSDP_JOBS:-16}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $commit"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu: /'
  python3 -c 'import torch; print("torch:", torch.__version__)'
} | tee "$out/env.txt"
bash scripts/test.sh 2>&1 | tee "$out/tests.log"
