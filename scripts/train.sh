#!/usr/bin/env bash
# Builds fsdp.cpp and runs a short training run of the tiny Llama model:
# on all local GPUs, or on 2 CPU ranks when there is no GPU. Extra arguments
# go to fsdp-train (see build/fsdp-train --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec build/fsdp-run build/fsdp-train --model tiny --steps 30 --seq 64 --log build/fsdp-train.jsonl "$@"
