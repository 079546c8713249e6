#!/usr/bin/env bash
# On a GPU machine: builds, runs the whole test suite (the GPU tests are
# registered there) and short 1B training runs, writing logs to OUT_DIR.
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
for variant in reshard no-reshard; do
  flag=; [ "$variant" = no-reshard ] && flag=--no-reshard-after-forward
  build/fsdp-run build/fsdp-train --model 1b --steps 12 --seq 2048 --batch 4 $flag \
    --log "$out/train-1b-$variant.jsonl" 2>&1 | tee "$out/train-1b-$variant.log"
done
