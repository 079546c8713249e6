#!/usr/bin/env bash
# Installs what fsdp.cpp needs and builds it into build/. Idempotent: a second
# run installs nothing and rebuilds only what changed.
#   torch: a python3 that already has torch 2.11 (the GPU machines), else a
#          venv at $FSDP_VENV (default ~/.cache/fsdp.cpp/venv) with the PyPI
#          wheel torch==2.11.0, installed once and reused by every checkout.
#   Debian packages: OpenMPI, GoogleTest, ninja, cmake, ccache, doxygen, toml++ (when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.11.0
VENV=${FSDP_VENV:-$HOME/.cache/fsdp.cpp/venv}
JOBS=${FSDP_JOBS:-2}

log() { echo "setup: $*"; }
# Machines that cannot reach a package index (the GPU machines) skip the installs that would only
# fail there, after retries (about 40 s a run); wheels carried in .whl/ still install.
online=1
timeout 5 getent hosts pypi.org >/dev/null 2>&1 || { online=; log "no network: installing from .whl/ alone"; }

missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin libopenmpi-dev)
[ -f /usr/include/gtest/gtest.h ] && [ -f /usr/include/gmock/gmock.h ] || missing+=(libgtest-dev libgmock-dev)
[ -f /usr/include/zlib.h ] || missing+=(zlib1g-dev)  # checkpoints' CRC-32
command -v ninja >/dev/null || missing+=(ninja-build)
command -v cmake >/dev/null || missing+=(cmake)
apt_install() {
  [ -n "$online" ] || { log "cannot install $* without a network"; return 1; }
  log "installing $*"
  local sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
[ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
# ccache only speeds up rebuilds: machines without a package mirror build without it.
command -v ccache >/dev/null || apt_install ccache || log "no ccache; building without it"
# doxygen builds the API reference (ctest api_docs); without it that test is not registered.
command -v doxygen >/dev/null || apt_install doxygen || log "no doxygen; the API reference test is skipped"
# toml++ reads fsdp-train --config FILE.toml; without it the trainer reads JSON configs only.
[ -f /usr/include/toml++/toml.h ] || apt_install libtomlplusplus-dev || log "no toml++; fsdp-train reads JSON configs only"

has_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; }
PYTHON=
for candidate in ${FSDP_PYTHON:-} python3 "$VENV/bin/python"; do
  if command -v "$candidate" >/dev/null 2>&1 && has_torch "$candidate"; then PYTHON=$candidate; break; fi
done
if [ -z "$PYTHON" ]; then
  python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
  log "installing torch==$TORCH_VERSION into $VENV (once; several GB of CUDA wheels)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
  PYTHON="$VENV/bin/python"
fi
TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
# Wheels carried to machines without a package index (the GPU machines) lie in .whl/.
pip_install() {
  if [ -d .whl ]; then "$PYTHON" -m pip install -q --no-index --find-links .whl "$@"
  elif [ -n "$online" ]; then "$PYTHON" -m pip install -q "$@"
  else return 1; fi
}
# The memory report's plots (bench/memreport.py, also a CI smoke test).
"$PYTHON" -c 'import matplotlib' 2>/dev/null || pip_install matplotlib \
  || log "no matplotlib; the memory-report test will be skipped"
# nlohmann/json (safetensors headers, config.json): Debian's headers, else the PyPI package's.
JSON_INCLUDE=
if [ ! -f /usr/include/nlohmann/json.hpp ]; then
  find_json() {
    "$PYTHON" -c 'import importlib.util, os; s = importlib.util.find_spec("nlohmann_json"); print(os.path.join(os.path.dirname(s.origin), "include"))' 2>/dev/null
  }
  find_json >/dev/null || pip_install --no-deps nlohmann-json==3.12.0
  JSON_INCLUDE=$(find_json)
fi
# The Hugging Face round-trip test loads our exports with transformers.
"$PYTHON" -c 'import transformers, safetensors' 2>/dev/null || pip_install transformers safetensors \
  || log "no transformers; the Hugging Face round-trip test will be skipped"
# The Python tests shard through accelerate's FSDP2 path (fsdpcpp.use_as_fsdp2).
"$PYTHON" -c 'import accelerate' 2>/dev/null || pip_install accelerate || log "no accelerate; its Python test will fail"

# fsdp-train --tensorboard writes through TensorBoard's own writer (torch.utils.tensorboard).
"$PYTHON" -c 'import tensorboard' 2>/dev/null || pip_install tensorboard \
  || log "no tensorboard; fsdp-train --tensorboard and its test will fail"
# fsdp-train --wandb logs through wandb itself (its test logs offline).
"$PYTHON" -c 'import wandb' 2>/dev/null || pip_install wandb || log "no wandb; fsdp-train --wandb will be refused and its test runs TensorBoard's half alone"
# pip install . (docs/python.md) builds through scikit-build-core, without build isolation.
"$PYTHON" -c 'import scikit_build_core' 2>/dev/null || pip_install scikit-build-core \
  || log "no scikit-build-core; pip install . of the Python package will fail"
# The Python package's tests (tests/python) run under pytest.
"$PYTHON" -c 'import pytest' 2>/dev/null || pip_install pytest || log "no pytest; the Python tests cannot run"

PYTHON_PATH=$(command -v "$PYTHON")
if [ ! -f build/build.ninja ] || ! grep -qF "$TORCH_PREFIX" build/CMakeCache.txt \
   || ! grep -qF "FSDP_PYTHON:FILEPATH=$PYTHON_PATH" build/CMakeCache.txt \
   || ! grep -q "^JSON_INCLUDE_DIR:PATH=/" build/CMakeCache.txt; then
  log "configuring build/ against $TORCH_PREFIX"
  cmake -G Ninja -S . -B build -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DFSDP_PYTHON="$PYTHON_PATH" \
    -DFSDP_JSON_INCLUDE="$JSON_INCLUDE" \
    >build-configure.log 2>&1 || { cat build-configure.log; exit 1; }
fi
# build/python: the python3 that has torch (a venv's on a fresh CPU machine), for the README's
# commands and the benchmark scripts: `build/python -c 'import torch'` works wherever setup ran.
printf '#!/bin/sh\nexec %s "$@"\n' "$PYTHON_PATH" >build/python
chmod +x build/python
log "building (ninja -j$JOBS)${FSDP_TARGETS:+: $FSDP_TARGETS}"
# FSDP_TARGETS: only these targets (e.g. "fsdpcpp_C fsdp-train fsdp-run" for a quick device run).
cmake --build build -j "$JOBS" ${FSDP_TARGETS:+--target $FSDP_TARGETS}
