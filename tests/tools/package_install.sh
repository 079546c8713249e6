#!/usr/bin/env bash
# The package as a user installs it: a wheel built from a fresh clone of this checkout
# with `pip wheel --no-build-isolation` (the python with torch, scripts/setup.sh's), installed into
# an empty prefix; then the installed `fsdp-train`, `fsdp-run` and `fsdp-prepare-data` commands (--version, a 2-rank
# run of the tiny model) and `import fsdpcpp` from there. Builds the library once more (about 8
# minutes on 2 cores): run by bench/gpu_checks.sh's package part, not by CI.
# FSDP_PACKAGE_WITHOUT_MPI=1: the wheel is built without MPI (`-C cmake.define.FSDP_WITH_MPI=OFF`,
# as on a GPU machine without MPI's development files) and its run is on a GPU.
# FSDP_PACKAGE_FROM_BUILD=1: the wheel scripts/wheel.sh makes from this checkout's build/ (seconds;
# ctest package_from_build), which must leave build/ as it found it.
#   bash tests/tools/package_install.sh [PYTHON] [WORK]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
python=${1:-$repo/build/python}
case $python in */*) python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python") ;; esac  # used from the clone
work=${2:-$(mktemp -d /tmp/fsdp-package.XXXXXX)}
fail() { echo "package_install: FAILED: $*"; exit 1; }
rm -rf "$work/src" "$work/wheel" "$work/prefix" && mkdir -p "$work"
without_mpi=${FSDP_PACKAGE_WITHOUT_MPI:-0}
if [ "${FSDP_PACKAGE_FROM_BUILD:-0}" = 1 ]; then
  # build/ as it was: a later `cmake --install build` installs where it did, its options and
  # nothing of scikit-build-core's left in the cache (the entries CMake's modules keep may differ),
  # and nothing to build.
  settings_of() { grep -E '^(CMAKE_INSTALL_PREFIX|FSDP_[A-Z_]+|SKBUILD[A-Z_]*):' "$repo/build/CMakeCache.txt"; }
  before=$(settings_of)
  bash "$repo/scripts/wheel.sh" "$work/wheel" > "$work/wheel.log" 2>&1 || { tail -30 "$work/wheel.log"; fail "scripts/wheel.sh"; }
  diff <(echo "$before") <(settings_of) || fail "scripts/wheel.sh changed build/'s settings"
  ! ninja -C "$repo/build" | grep -E "Building|Linking" || fail "build/ had work to do after scripts/wheel.sh"
else
  # A fresh clone of a clean checkout; otherwise (changes not committed, or a copied tree whose .git
  # is not its own, as on the GPU machines) its files but build/.
  if git -C "$repo" diff --quiet HEAD -- 2>/dev/null; then
    git clone -q "$repo" "$work/src"
  else
    mkdir -p "$work/src" && tar -C "$repo" --exclude=./build --exclude=./.git -cf - . | tar -C "$work/src" -xf -
  fi
  # Build only what the wheel needs; the clone has no build/ of its own.
  settings=() && [ "$without_mpi" = 1 ] && settings=(-C cmake.define.FSDP_WITH_MPI=OFF)
  (cd "$work/src" && "$python" -m pip wheel -q --no-build-isolation --no-deps "${settings[@]}" -w "$work/wheel" .) \
    > "$work/wheel.log" 2>&1 || { tail -30 "$work/wheel.log"; fail "pip wheel"; }
fi
wheel=$(ls "$work"/wheel/fsdpcpp-*.whl) || fail "no wheel in $work/wheel"
"$python" -m pip install -q --no-deps --prefix "$work/prefix" "$wheel" > "$work/install.log" 2>&1 ||
  { cat "$work/install.log"; fail "pip install of $wheel"; }
# Where pip put the commands and the package under the prefix (its scheme differs between
# interpreters: bin/ or local/bin/, site-packages or dist-packages); the commands are pip's
# scripts, not the programs they start in the package's fsdpcpp/bin/.
bin=$(find "$work/prefix" -type f -path '*/bin/fsdp-train' -not -path '*/fsdpcpp/bin/*' -printf '%h\n' | head -1)
site=$(find "$work/prefix" -type d -name fsdpcpp -path '*-packages/*' -printf '%h\n' | head -1)
[ -n "$bin" ] && [ -n "$site" ] ||
  fail "no bin/fsdp-train or fsdpcpp package under the prefix: $(cd "$work/prefix" && find . -maxdepth 4 | tr '\n' ' ')"
export PATH="$bin:$PATH" PYTHONPATH="$site"
for program in fsdp-train fsdp-run; do
  [ "$(command -v $program)" = "$bin/$program" ] || fail "$program is '$(command -v $program)', not $bin/$program"
  $program --version | grep -q "^$program [0-9]" || fail "$program --version"
done
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
launch=(-n 2 --cpu) && [ "$gpus" -ge 1 ] && launch=(--gpu -n 1)
[ "$without_mpi" = 1 ] && [ "$gpus" -lt 1 ] && fail "a wheel without MPI runs on GPUs only, and torch sees none"
if [ "$without_mpi" = 1 ]; then  # the CPU backend refuses, naming the fix
  CUDA_VISIBLE_DEVICES= fsdp-train --model tiny --steps 1 > "$work/cpu.log" 2>&1 && fail "a CPU run without MPI"
  grep -q "this build has no MPI backend" "$work/cpu.log" || { cat "$work/cpu.log"; fail "the CPU run's error"; }
fi
fsdp-run "${launch[@]}" fsdp-train --model tiny --seq 32 --steps 3 --overwrite-log --log "$work/train.jsonl" > "$work/train.log" 2>&1 ||
  { cat "$work/train.log"; fail "fsdp-run fsdp-train from the wheel"; }
grep -q '"step": *3' "$work/train.jsonl" || fail "the installed fsdp-train did not log step 3"
# fsdp-prepare-data is the package's command too (ctest prepare_data tests what it writes).
[ "$(command -v fsdp-prepare-data)" = "$bin/fsdp-prepare-data" ] || fail "no fsdp-prepare-data command in $bin"
fsdp-prepare-data --help | grep -q "^usage: fsdp-prepare-data" || fail "fsdp-prepare-data --help"
(cd "$work" && "$python" -c 'import fsdpcpp, sys; assert fsdpcpp.__file__.startswith(sys.argv[1]), fsdpcpp.__file__' "$site") ||
  fail "import fsdpcpp from the installed package"
echo "package_install: ok ($(basename "$wheel"), $(du -h "$wheel" | cut -f1)$([ "$without_mpi" = 1 ] && echo ', without MPI'))"
