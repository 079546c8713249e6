#!/usr/bin/env bash
# Builds fsdp.cpp and runs a short training run of the tiny Llama model:
# on all local GPUs, or on 2 CPU ranks when there is no GPU. Extra arguments
# go to fsdp-train (see build/fsdp-train --help).
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what it runs is built (the library, fsdp-train, fsdp-run; scripts/test.sh builds the rest).
FSDP_TARGETS=${FSDP_TARGETS:-fsdp-train fsdp-run} bash scripts/setup.sh
# Each run logs to a new runs/<date-time>-<run id>/fsdp-train.jsonl (a log is never emptied).
exec build/fsdp-run build/fsdp-train --model tiny --steps 30 --seq 64 "$@"
