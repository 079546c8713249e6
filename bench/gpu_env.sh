# Sourced by the GPU-machine scripts: the environment every GPU record runs under (multicast off,
# mpirun as root, unbuffered Python) and record_env FILE COMMIT, which writes the record's
# date, commit, GPUs, driver and torch version, build_with_log, the build, and build_and_test, the
# build + ctest phase.
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
# build_with_log LOG: setup.sh with every core (incremental on a warm machine), its output to LOG;
# on failure prints LOG's tail and returns non-zero.
build_with_log() {
  FSDP_JOBS=$(nproc) bash scripts/setup.sh > "$1" 2>&1 || { tail -30 "$1"; return 1; }
}
# build_and_test OUT LINES [CTEST ARGS]: builds through setup.sh (log OUT/build.log), runs ctest
# (log OUT/tests.log), prints the last LINES result lines; returns ctest's status.
build_and_test() {
  local out=$1 lines=$2; shift 2
  build_with_log "$out/build.log" || return 1
  (cd build && ctest --output-on-failure "$@") > "$out/tests.log" 2>&1
  local ok=$?
  grep -E "Test +#|tests passed|FAILED|Failed" "$out/tests.log" | tail -"$lines"
  return $ok
}
