#!/usr/bin/env bash
# Builds fsdp.cpp and runs the whole test suite (CPU ranks under mpirun; the
# GPU tests too where the build machine has NVIDIA GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two tests at a time on a machine without GPUs (most are a few processes that wait on one another;
# the suite passes under load), one at a time beside GPUs (their tests share them). FSDP_TEST_JOBS
# overrides.
jobs=${FSDP_TEST_JOBS:-$(command -v nvidia-smi > /dev/null && echo 1 || echo 2)}
ctest --test-dir build --output-on-failure -j "$jobs" "$@"
