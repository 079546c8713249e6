# Sourced by the GPU-machine scripts: the environment every GPU record runs under (multicast off,
# mpirun as root, unbuffered Python) and record_env FILE COMMIT, which writes the record's
# date, commit, GPUs, driver and torch version.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
record_env() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $2"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu: /'
    python3 -c 'import torch; print("torch:", torch.__version__)'
  } > "$1"
}
