#!/usr/bin/env bash
# The README's main job (scripts/train.sh) builds only what it runs: the targets it names and all
# they are built from lie outside tests/ (the test binaries are scripts/test.sh's), so the first run
# on a fresh machine does not wait for them.
#   train_path_targets.sh REPO BUILD_DIR
set -euo pipefail
repo=$1 build=$2
targets=$(sed -n 's/^FSDP_TARGETS=\${FSDP_TARGETS:-\([^}]*\)}.*/\1/p' "$repo/scripts/train.sh")
[ -n "$targets" ] || { echo "FAIL: scripts/train.sh names no FSDP_TARGETS default"; exit 1; }
inputs=$(ninja -C "$build" -t inputs $targets)
count=$(grep -c . <<<"$inputs")
from_tests=$(grep -E "(^|/)tests/" <<<"$inputs" || true)
[ -z "$from_tests" ] || { echo "FAIL: the train path ($targets) builds test files:"; echo "$from_tests" | head; exit 1; }
echo "train_path_targets: $targets from $count inputs, none of them tests: ok"
