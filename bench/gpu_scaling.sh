#!/usr/bin/env bash
# The 2- and 4-GPU record of a commit on a machine of 4 GPUs, one phase per
# device call (each under 10 minutes; back to back, the machine stays warm and the build is kept):
#   bash bench/gpu_scaling.sh bench OUT COMMIT [CONFIGS] [REPEATS]
#        build; bench/run_bench.py on 2 and 4 GPUs (default configs 1b,1b-ac,3b,8b,8b-ac, each against
#        FSDP2 eager and compiled and the Python front end where run_bench pairs them; REPEATS runs,
#        default 3; more configs than fit one call: pass a few at a time; the 8B on 2 GPUs needs H200s:
#        its sharded weights, gradients and AdamW state alone are ~60 GiB a GPU there; BENCH_WORLDS=2
#        runs the 2-GPU half alone, on a machine of 2 GPUs)
#   bash bench/gpu_scaling.sh hsdp OUT COMMIT       the 8B as HSDP 2 x 2 (two replicas of 2 GPUs) and as
#        plain FSDP 1 x 4, 15 steps each, rank 0 traced
#   bash bench/gpu_scaling.sh plan-check OUT COMMIT fsdp-train --plan-check on 4 GPUs (the 1B): each
#        budget's plan trained, predicted against measured, then bench/plan_frontier.py's verdict
#   bash bench/gpu_scaling.sh checkpoint OUT COMMIT the 1B saved on 2 GPUs at step 10 and resumed on 4,
#        and saved on 4 and resumed on 2: each resumed run's steps against an uninterrupted run's
#   bash bench/gpu_scaling.sh memreport OUT COMMIT  bench/memreport.py on the 4 GPUs
#   bash bench/gpu_scaling.sh projection OUT COMMIT [MODELS]  each model's (default 8b) cost model
#        profiled on 2 and on 4 GPUs (--plan-only --cost-model) and the step it projects (the default
#        schedule with --recompute) measured there; both cost models projected to 2-512 GPUs
#        (fsdp-train --project) and set beside the measured steps
#   bash bench/gpu_scaling.sh projection-70b OUT COMMIT   Llama-3.1-70B's shapes with 4 of its 80 blocks
#        (bench/llama_slice.py) profiled on 2 GPUs and its step (--recompute) measured there and
#        projected; the cost model stretched to 80 blocks (bench/stretch_cost_model.py) and projected
#        to 8-512 GPUs
#   bash bench/gpu_scaling.sh projection-seq OUT COMMIT SEQ   the 8B's and the 70B's (4 blocks, stretched
#        to 80) cost models profiled on 2 GPUs at sequence length SEQ, batch 2, projected to 8-512
#        GPUs with every block recomputed: torchtitan's published runs use seq 8192
#   bash bench/gpu_scaling.sh holes OUT COMMIT [GPUS] [MODEL]   where a recomputed model's (default 8b;
#        3b) reserved-but-free memory sits at its peak, bf16 and float8: an
#        allocator snapshot of step 5 on GPUS (default 4) GPUs through bench/snapshot_holes.py
# Logs and JSON lines to OUT; weights, checkpoints and profiles of ranks other than 0 stay in
# /tmp (the device brings back only a few files: archive OUT yourself).
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase: bench, hsdp, plan-check, checkpoint, memreport, projection, projection-70b, projection-seq or holes}; out=${2:?output folder}; commit=${3:-unknown}
source bench/gpu_env.sh
mkdir -p "$out"
record_env "$out/env-$phase.txt" "$commit"
build_with_log "$out/build-$phase.log" || exit 1
train() {  # GPUS, then fsdp-train's flags
  local gpus=$1; shift
  build/fsdp-run --gpu -n "$gpus" build/fsdp-train --param-dtype bf16 --reduce-dtype fp32 "$@"
}
# The 70B's projection: Llama-3.1-70B's shapes with 4 of its 80 blocks, written to
# /tmp (random weights: bench/llama_slice.py); the slice's cost model carried to 80 blocks and
# projected to 8-512 GPUs, every block recomputed.
slice_70b=/tmp/llama-70b-4 far_worlds=8,16,32,64,128,256,512
write_70b_slice() {
  rm -rf "$slice_70b"
  python3 bench/llama_slice.py --model 70b --layers 4 --out "$slice_70b"
}
# A model's cost model profiled on GPUS GPUs: OUT/cost-NAME.json. It is written before the plan, so
# a budget no schedule fits (an H100's, say) still leaves it: success is the file.
cost_model() {  # GPUS NAME BUDGET_GIB, then the model's and shape's flags
  local gpus=$1 name=$2 budget=$3; shift 3
  rm -f "$out/cost-$name.json"
  train "$gpus" "$@" --steps 5 --memory-budget "$budget" --plan-only --cost-model "$out/cost-$name.json" \
    --overwrite-log --log "$out/plan-$name.jsonl" > "$out/plan-$name.log" 2>&1
  [ -s "$out/cost-$name.json" ] || { tail -5 "$out/plan-$name.log"; return 1; }
}
project_70b() {  # SLICE_NAME NAME: OUT/cost-SLICE_NAME.json stretched to OUT/cost-NAME.json, projected
  python3 bench/stretch_cost_model.py "$out/cost-$1.json" --blocks 80 --out "$out/cost-$2.json" &&
    build/fsdp-train --project "$out/cost-$2.json" --project-worlds "$far_worlds" --recompute | tee "$out/projected-$2.txt"
}
one_b=(--model 1b --seq 2048)
case $phase in
  bench)
    work=/tmp/fsdp-scaling-bench
    rm -rf "$work"
    python3 bench/run_bench.py --out "$work" --commit "$commit" --worlds "${BENCH_WORLDS:-2,4}" \
      --configs "${4:-1b,1b-ac,3b,8b,8b-ac}" --repeats "${5:-3}" > "$out/run_bench.log" 2>&1
    status=$?
    tail -40 "$out/run_bench.log"
    cp "$work"/results.md "$work"/results.jsonl "$work"/profiles.md "$out"/ 2>/dev/null
    (cd "$work" && tar czf "$out/bench-logs.tgz" --exclude='*.pt' --exclude='profile-*' --exclude='trace-*' .)
    exit $status ;;
  hsdp)
    status=0
    for replicas in 2 1; do
      train 4 --model 8b --seq 2048 --batch 2 --steps 15 --replicas $replicas --trace "/tmp/trace-8b-r$replicas" \
        --trace-steps 1 --overwrite-log --log "$out/hsdp-8b-r$replicas.jsonl" > "$out/hsdp-8b-r$replicas.log" 2>&1 || status=1
      tail -2 "$out/hsdp-8b-r$replicas.log"
    done
    python3 - "$out" <<'PY'
import sys
sys.path.insert(0, "bench")
import step_log
for replicas, shape in ((2, "HSDP 2 x 2"), (1, "FSDP 1 x 4")):
    rows = step_log.read(f"{sys.argv[1]}/hsdp-8b-r{replicas}.jsonl")
    print(f"8B {shape}: {step_log.median_step_ms(rows, 5):.1f} ms a step, peak allocated / reserved "
          f"{max(r['peak_alloc_gib'] for r in rows):.2f} / {max(r['peak_reserved_gib'] for r in rows):.2f} GiB")
PY
    exit $status ;;
  plan-check)
    train 4 "${one_b[@]}" --batch 4 --steps 5 --plan-check "$out/plan-check-1b.jsonl" --overwrite-log --log "$out/plan-1b.jsonl" \
      > "$out/plan-check-1b.log" 2>&1 || { tail -20 "$out/plan-check-1b.log"; exit 1; }
    python3 bench/plan_frontier.py --check "$out/plan-check-1b.jsonl" --out "$out/frontier-1b" --world 4 ;;
  checkpoint)
    ck=/tmp/fsdp-scaling-checkpoints
    rm -rf "$ck" && mkdir -p "$ck"
    status=0
    # 16 rows a step on any GPU count; a learning rate at which two 1B runs do not part (1b-lowlr).
    one_b+=(--lr 1e-4 --min-lr 1e-5)
    train 4 "${one_b[@]}" --batch 4 --steps 20 --overwrite-log --log "$out/straight-1b.jsonl" > "$out/straight-1b.log" 2>&1 || status=1
    for pair in "2 4" "4 2"; do
      read -r saved resumed <<<"$pair"
      train "$saved" "${one_b[@]}" --batch $((16 / saved)) --steps 20 --stop-at-step 10 --save-dir "$ck/$saved" \
        --overwrite-log --log "$out/saved-on-$saved.jsonl" > "$out/saved-on-$saved.log" 2>&1 || status=1
      train "$resumed" "${one_b[@]}" --batch $((16 / resumed)) --steps 20 --resume "$ck/$saved" \
        --overwrite-log --log "$out/resumed-on-$resumed.jsonl" > "$out/resumed-on-$resumed.log" 2>&1 || status=1
      grep -hE "saved|resumed|error" "$out/saved-on-$saved.log" "$out/resumed-on-$resumed.log"
      # bf16 on GPUs: the check is a loose bound; the report gives the largest difference.
      python3 tests/trainer/check_train_log.py "$out/resumed-on-$resumed.jsonl" --first-step 11 --steps 20 \
        --same-loss-as "$out/straight-1b.jsonl" --loss-tolerance 0.05 | tee "$out/resume-$saved-to-$resumed.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    rm -rf "$ck"
    exit $status ;;
  memreport)
    python3 bench/memreport.py --out "$out/memreport" --commit "$commit" > "$out/memreport.log" 2>&1
    status=$?
    tail -14 "$out/memreport.log"
    rm -f "$out"/memreport/init-*.pt
    exit $status ;;
  projection)
    status=0 models=${4:-8b}
    for model in ${models//,/ }; do
      for gpus in 2 4; do
        name=$model-w$gpus
        cost_model $gpus "$name" 70 --model "$model" --seq 2048 --batch 2 || { status=1; continue; }
        train $gpus --model "$model" --seq 2048 --batch 2 --steps 10 --recompute --overwrite-log --log "$out/measured-$name.jsonl" \
          > "$out/measured-$name.log" 2>&1 || { tail -5 "$out/measured-$name.log"; status=1; }
        build/fsdp-train --project "$out/cost-$name.json" --project-worlds 2,4,8,16,32,64,128,256,512 --recompute \
          > "$out/projected-from-$name.txt" 2>&1 || status=1
        cat "$out/projected-from-$name.txt"
      done
    done
    python3 - "$out" ${models//,/ } <<'PY'
import os, re, sys
sys.path.insert(0, "bench")
import step_log
out = sys.argv[1]
for model in sys.argv[2:]:
    for gpus in (2, 4):
        path = f"{out}/measured-{model}-w{gpus}.jsonl"
        if not os.path.exists(path):
            continue
        rows = step_log.read(path)
        print(f"{model} measured on {gpus} GPUs: {step_log.median_step_ms(rows, 3):.1f} ms, "
              f"peak allocated {max(r['peak_alloc_gib'] for r in rows):.2f} GiB")
        for source in (2, 4):
            projected = f"{out}/projected-from-{model}-w{source}.txt"
            if not os.path.exists(projected):
                continue
            for line in open(projected):
                m = re.match(rf"\s+{gpus}\s+FSDP\s+([\d.]+)\s+([\d.]+)\s+([\d.]+ \w+)", line)
                if m:
                    print(f"  projected from {source} GPUs: {m.group(1)} ms (exposed comm {m.group(2)} ms), "
                          f"peak {m.group(3)}")
PY
    exit $status ;;
  projection-70b)
    shape=(--seq 2048 --batch 2)
    write_70b_slice || exit 1
    cost_model 2 70b4-w2 70 --init-from "$slice_70b" "${shape[@]}" || exit 1
    train 2 --init-from "$slice_70b" "${shape[@]}" --steps 10 --recompute --overwrite-log --log "$out/measured-70b4-w2.jsonl" \
      > "$out/measured-70b4-w2.log" 2>&1 || { tail -5 "$out/measured-70b4-w2.log"; exit 1; }
    rm -rf "$slice_70b"
    python3 - "$out/measured-70b4-w2.jsonl" <<'PY'
import sys
sys.path.insert(0, "bench")
import step_log
rows = step_log.read(sys.argv[1])
print(f"70B's shapes, 4 blocks, measured on 2 GPUs: {step_log.median_step_ms(rows, 3):.1f} ms, "
      f"peak allocated {max(r['peak_alloc_gib'] for r in rows):.2f} GiB")
PY
    build/fsdp-train --project "$out/cost-70b4-w2.json" --project-worlds 2 --recompute | tee "$out/projected-70b4.txt"
    project_70b 70b4-w2 70b-w2 ;;
  projection-seq)
    seq=${4:?the sequence length}
    shape=(--seq "$seq" --batch 2)
    write_70b_slice || exit 1
    # The profiled steps recompute every block (--memory-budget refuses --recompute): the projection
    # asks for that schedule.
    cost_model 2 8b-s$seq-w2 120 --model 8b "${shape[@]}" || exit 1
    cost_model 2 70b4-s$seq-w2 120 --init-from "$slice_70b" "${shape[@]}" || exit 1
    rm -rf "$slice_70b"
    build/fsdp-train --project "$out/cost-8b-s$seq-w2.json" --project-worlds "$far_worlds" --recompute |
      tee "$out/projected-8b-s$seq-w2.txt"
    project_70b 70b4-s$seq-w2 70b-s$seq-w2 ;;
  holes)
    status=0 gpus=${4:-4} model=${5:-8b}
    batch=2; [ "$model" = 3b ] && batch=4  # the shapes of the A/Bs in bench/results (3B: batch 4)
    for precision in bf16 fp8; do
      name=$model-ac-$precision-w$gpus flags=(); [ $precision = fp8 ] && flags=(--fp8 tensorwise)
      train "$gpus" --model "$model" --seq 2048 --batch $batch --recompute "${flags[@]}" --steps 6 \
        --memory-snapshot "/tmp/snapshot-$name" --overwrite-log --log "$out/snapshot-$name.jsonl" > "$out/snapshot-$name.log" 2>&1 ||
        { tail -5 "$out/snapshot-$name.log"; status=1; continue; }
      python3 bench/snapshot_holes.py "/tmp/snapshot-$name-rank0.pickle" --step 5 --explain 6 \
        > "$out/holes-$name.txt" 2>&1 || status=1
      head -30 "$out/holes-$name.txt"
      rm -f /tmp/snapshot-"$name"-rank*.pickle  # the holes are kept; the history is large
    done
    exit $status ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
