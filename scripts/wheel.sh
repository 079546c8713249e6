#!/usr/bin/env bash
# The Python package's wheel from this checkout's own build (build/, made by scripts/setup.sh),
# without building the library a second time: scikit-build-core configures build/ again with the
# package's options (build/'s tests kept), builds the wheel's targets (nothing when build/ is
# current) and packs CMake's install component `wheel`. Install it into any environment whose
# torch is the one build/ links (build/python's):
#   bash scripts/wheel.sh [OUT_DIR]          (default dist/)
#   build/python -m pip install OUT_DIR/fsdpcpp-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
[ -x build/python ] && [ -f build/build.ninja ] || { echo "wheel: no build/ here: run scripts/setup.sh first"; exit 1; }
mkdir -p "$out"
# build/'s own choice of tests, not the package's OFF: the configure must leave build/ as it was.
tests=$(sed -n 's/^FSDP_BUILD_TESTS:BOOL=//p' build/CMakeCache.txt)
prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' build/CMakeCache.txt)
echo "wheel: packing build/ into $out/ (configure, the package's targets, install: seconds when build/ is current)"
build/python -m pip wheel -q --no-build-isolation --no-deps -C build-dir=build \
  -C cmake.define.FSDP_BUILD_TESTS=${tests:-ON} -w "$out" .
# `cmake --install build` goes on installing where it did, not into pip's temporary folder.
cmake -U "SKBUILD*" -DCMAKE_INSTALL_PREFIX="$prefix" build >build/wheel-configure.log 2>&1 ||
  { cat build/wheel-configure.log; exit 1; }
ls -t "$out"/fsdpcpp-*.whl | head -1 | sed 's/^/wheel: /'
