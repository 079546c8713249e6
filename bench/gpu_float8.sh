#!/usr/bin/env bash
# Issue #32's float8 records on one GPU, each phase one device call (the build stays between them
# only within a call; every phase builds through setup.sh, a no-op when built):
#   bash bench/gpu_float8.sh speed OUT COMMIT [ROUNDS]  the float8 GPU tests; fsdp-train's 1B (seq 2048,
#        batch 4) and 3B (seq 2048, batch 2) in each of FLOAT8_VARIANTS (default: off = bf16, tensorwise
#        with float8 all-gather, tensorwise-cast = tensorwise with --no-fp8-all-gather, rowwise), ROUNDS
#        rounds (default 3) alternating; FSDP2 + torchao float8 tensorwise + compile on the same models
#        (the torchao wheel in .whl/); a profile of each model's fsdp-train float8 step (FLOAT8_PROFILES:
#        the models profiled, default "1b 3b"). FLOAT8_MODELS: the models run (default "1b 3b");
#        FLOAT8_SNAPSHOTS: models whose float8 tensorwise run also records the allocator's history
#        (default none), and where reserved-but-free memory sits at its peak (bench/snapshot_holes.py);
#        FLOAT8_GPUS: GPUs each run uses (default 1; more shard over them, the batch per GPU the same);
#        FLOAT8_TORCHAO=0 skips FSDP2 + torchao; FLOAT8_VARIANTS="" runs FSDP2 + torchao alone
#   bash bench/gpu_float8.sh loss OUT COMMIT            loss curves on real text (.data/ from
#        bench/text_corpus.sh): the small model 1000 steps and the 1B 200 steps, bf16 against float8
#        (FLOAT8_LOSS_VARIANTS: the variants run, as FLOAT8_VARIANTS; default "off tensorwise rowwise")
#   bash bench/gpu_float8.sh loss-1b OUT COMMIT [STEPS]  the 1B alone, STEPS steps (default 600)
# Logs, JSON lines and summaries to OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase}; out=${2:?output folder}; commit=${3:-unknown}; rounds=${4:-3}
source bench/gpu_env.sh
mkdir -p "$out"
record_env "$out/env-$phase.txt" "$commit"
cat "$out/env-$phase.txt"
build_with_log "$out/build-$phase.log" || exit 1
gpus=${FLOAT8_GPUS:-1}
train() { build/fsdp-run --gpu -n "$gpus" build/fsdp-train --param-dtype bf16 "$@"; }
# fsdp-train's flags for a variant: off, tensorwise, rowwise, or tensorwise-cast (--no-fp8-all-gather).
variant_flags() {
  flags=(--fp8 "${1%-cast}")
  [ "$1" = tensorwise-cast ] && flags+=(--no-fp8-all-gather)
}
status=0
declare -A shape=([1b]="--seq 2048 --batch 4" [3b]="--seq 2048 --batch 2")
case $phase in
  speed)
    mpirun -n 1 build/tests/lib/fsdp_gpu_tests --gtest_filter='Gpu.Float8*' > "$out/float8-gpu-tests.log" 2>&1 || status=1
    grep -E "OK|FAILED|PASSED" "$out/float8-gpu-tests.log"
    build/python -m pip install -q --no-index --no-deps .whl/torchao-*.whl > "$out/torchao-install.log" 2>&1 || status=1
    torchao() {  # model, float8 recipe, round
      PYTHONPATH=build/py build/python -m torch.distributed.run --standalone --nproc-per-node="$gpus" bench/fsdp2_llama.py \
        --model "$1" ${shape[$1]} --steps 15 --compile --fp8 "$2" --jsonl "$out/$1-torchao-$2-$3.jsonl" \
        > "$out/$1-torchao-$2-$3.log" 2>&1 || status=1
    }
    for round in $(seq 1 "$rounds"); do
      for model in ${FLOAT8_MODELS:-1b 3b}; do
        for variant in ${FLOAT8_VARIANTS-off tensorwise tensorwise-cast rowwise}; do
          variant_flags "$variant"
          train --model "$model" ${shape[$model]} --steps 15 "${flags[@]}" --overwrite-log --log "$out/$model-$variant-$round.jsonl" \
            > "$out/$model-$variant-$round.log" 2>&1 || status=1
        done
        [ "${FLOAT8_TORCHAO:-1}" = 0 ] || torchao "$model" tensorwise "$round"
      done
    done
    for model in ${FLOAT8_PROFILES-1b 3b}; do  # FLOAT8_PROFILES="" skips the profiles
      train --model "$model" ${shape[$model]} --steps 6 --fp8 tensorwise --profile "$out/profile-$model-tensorwise" \
        --overwrite-log --log "$out/profile-$model.jsonl" > "$out/profile-$model.log" 2>&1 || status=1
      python3 bench/profile_summary.py "$out/profile-$model-tensorwise-rank0.json" --top 25 \
        > "$out/profile-$model-tensorwise.txt" 2>&1
      rm -f "$out/profile-$model-tensorwise-rank0.json"  # the summary is kept; the trace is ~100 MB
    done
    for model in ${FLOAT8_SNAPSHOTS-}; do
      train --model "$model" ${shape[$model]} --steps 6 --fp8 tensorwise --memory-snapshot "$out/snapshot-$model" \
        --overwrite-log --log "$out/snapshot-$model.jsonl" > "$out/snapshot-$model.log" 2>&1 || status=1
      python3 bench/snapshot_holes.py "$out/snapshot-$model-rank0.pickle" --step 5 --explain 6 \
        > "$out/snapshot-$model-holes.txt" 2>&1 || status=1
      rm -f "$out/snapshot-$model-rank0.pickle"  # the holes are kept; the history is large
    done
    python3 bench/float8_summary.py "$out" > "$out/summary.md" || status=1
    cat "$out/summary.md" ;;
  loss|loss-1b)
    [ -f .data/vim-docs-train.txt ] || { echo "no .data/vim-docs-train.txt: run bench/text_corpus.sh .data here and carry .data"; exit 1; }
    data=(--data .data/vim-docs-train.txt --eval-data .data/vim-docs-eval.txt --eval-batches 8)
    declare -A run=(
      [small]="--seq 512 --batch 16 --steps 1000 --lr 1e-3 --min-lr 1e-4 --warmup 50 --eval-every 250"
      [1b]="--seq 2048 --batch 4 --steps 200 --lr 3e-4 --min-lr 3e-5 --warmup 20 --eval-every 100")
    models=(small 1b)
    if [ "$phase" = loss-1b ]; then
      models=(1b)
      run[1b]="${run[1b]/--steps 200/--steps ${4:-600}}"
    fi
    for fp8 in ${FLOAT8_LOSS_VARIANTS:-off tensorwise rowwise}; do
      variant_flags "$fp8"
      for model in "${models[@]}"; do
        train --model "$model" ${run[$model]} "${data[@]}" "${flags[@]}" --overwrite-log --log "$out/loss-$model-$fp8.jsonl" \
          > "$out/loss-$model-$fp8.log" 2>&1 || status=1
      done
    done
    python3 bench/float8_summary.py --loss "$out" > "$out/loss-summary.md" || status=1
    cat "$out/loss-summary.md" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
exit $status
