#!/usr/bin/env bash
# Builds fsdp.cpp and runs the whole test suite (CPU ranks under mpirun; the
# GPU tests too where the build machine has NVIDIA GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure "$@"
