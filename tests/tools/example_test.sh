#!/usr/bin/env bash
# An example project built against an installed fsdp.cpp the way the README's "Using fsdp.cpp in
# your project" shows (cmake --install, find_package(fsdp) from the prefix), then run on 2 CPU
# ranks. Paths stay fixed under the build folder so ccache serves repeated runs.
#   bash tests/tools/example_test.sh BUILD_DIR EXAMPLE TORCH_DIR
set -euo pipefail
build=$(cd "$1" && pwd); example=$2; torch_dir=$3
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
prefix=$build/example-prefix-$example; example_build=$build/examples/$example; log=$build/example-$example.log
rm -rf "$prefix"
cmake --install "$build" --prefix "$prefix" > "$log"
launcher=()
if command -v ccache > /dev/null; then
  launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=cmake;-E;env;CCACHE_BASEDIR=$source_dir;CCACHE_NOHASHDIR=1;ccache")
fi
if ! cmake -G Ninja -S "$source_dir/examples/$example" -B "$example_build" -DCMAKE_PREFIX_PATH="$prefix" \
    -DTorch_DIR="$torch_dir" "${launcher[@]}" >> "$log" 2>&1 || ! cmake --build "$example_build" >> "$log" 2>&1; then
  tail -40 "$log"
  echo "example_test: $example did not configure or build against the installed package (log: $log)"
  exit 1
fi
# The package holds headers, the library and its CMake files, nothing from src/.
find "$prefix" -type f | sed "s|^$prefix/||" | sort | grep -v '^include/fsdp/' | tr '\n' ' '; echo
if grep -rq '#include "\(comm\|io\|model\|plan\|runtime\|sched\|shard\|train\)/' "$prefix/include"; then
  echo "example_test: an installed header includes a file from src/"
  exit 1
fi
# 2 CPU ranks wherever it runs (a machine with one GPU too), started as the README starts them.
"$build/fsdp-run" -n 2 --cpu "$example_build/$example"
