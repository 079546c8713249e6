#!/usr/bin/env bash
# A build without MPI (FSDP_WITH_MPI=OFF, as where CMake finds none): configuring the tests is
# refused naming the fix; the library configures with its MPI backend off, and the one source that
# uses MPI beside the backend (src/comm/launch.cpp: the CPU backend's refusal, the NCCL id under
# mpirun) compiles without a reference to MPI. The whole wheel without MPI is built and run on a
# GPU by bench/gpu_checks.sh's package part (tests/tools/package_install.sh).
#   bash tests/tools/build_without_mpi.sh SOURCE_DIR WORK_DIR TORCH_DIR JSON_INCLUDE
set -euo pipefail
src=${1:?source dir} work=${2:?work dir} torch_dir=${3:?Torch_DIR} json=${4:?nlohmann/json include dir}
fail() { echo "build_without_mpi: FAILED: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
configure() {
  cmake -G Ninja -S "$src" -B "$work/build" -DTorch_DIR="$torch_dir" -DFSDP_JSON_INCLUDE="$json" \
    -DFSDP_WITH_MPI=OFF -DFSDP_BUILD_PYTHON=OFF "$@" > "$work/configure.log" 2>&1
}
configure -DFSDP_BUILD_TESTS=ON && fail "the tests configured without MPI"
grep -q "FSDP_BUILD_TESTS needs MPI" "$work/configure.log" || { cat "$work/configure.log"; fail "the tests' refusal"; }
rm -rf "$work/build"
if ! configure -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_TOOLS=OFF; then
  # A torch without CUDA has no NCCL either: then nothing is left to build, and it says so.
  grep -q "needs MPI (CPU ranks) or NCCL (GPUs) and has neither" "$work/configure.log" ||
    { cat "$work/configure.log"; fail "configure"; }
  echo "build_without_mpi: ok (no NCCL here: refused, naming the fix)"
  exit 0
fi
grep -q "MPI backend OFF" "$work/configure.log" || { cat "$work/configure.log"; fail "MPI backend not off"; }
object=CMakeFiles/fsdp.dir/src/comm/launch.cpp.o
ninja -C "$work/build" "$object" > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; fail "launch.cpp"; }
if nm -u "$work/build/$object" | grep -q "MPI_"; then fail "launch.cpp refers to MPI: $(nm -u "$work/build/$object" | grep MPI_ | head -3)"; fi
echo "build_without_mpi: ok"
