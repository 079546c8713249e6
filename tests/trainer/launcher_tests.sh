#!/usr/bin/env bash
# fsdp-run + fsdp-train as a user meets them. Run by ctest:
#   launcher_tests.sh BUILD_DIR usage         every usage error: one line, exit 2, under fsdp-run
#   launcher_tests.sh BUILD_DIR write-fails   a log that cannot be written: an error, exit 1, no "done"
#   launcher_tests.sh BUILD_DIR train STEPS "CHECKS" FSDP_RUN_ARGS... -- FSDP_TRAIN_ARGS...
#                                             a run whose log passes check_train_log.py CHECKS
#   launcher_tests.sh BUILD_DIR resume [cpu|gpu]
#                                             checkpoints: 20 steps straight = 10 + save + resume + 10,
#                                             bit for bit on the same ranks; the 3-rank checkpoint
#                                             resumed on 1, 2 and 4 ranks follows the same losses; the
#                                             straight run's --async-save checkpoint of step 10 holds
#                                             the bits the stopped run saved there
#   launcher_tests.sh BUILD_DIR killed-save   a rank killed while saving every step (and with
#                                             --async-save): the newest complete checkpoint resumes
#   launcher_tests.sh BUILD_DIR signal-save   SIGTERM to fsdp-run: every rank saves at the step
#                                             boundary and exits 3 (resumable), which fsdp-run passes
#                                             on; the run resumes from there
#   launcher_tests.sh BUILD_DIR tp            --tp: tp 2, dp 2 x tp 2 and HSDP 2 x 2 x tp 2 (tied
#                                             embeddings, recomputed blocks) follow one process's losses,
#                                             gradient norms and held-out loss, and export its weights,
#                                             which --init-from reads into the parts alike; offload,
#                                             the optimizer in backward, buckets and kept parameters
#                                             under tp follow it too;
#                                             checkpoints saved with and without tp resume on other
#                                             (dp, tp) layouts and hold the same tensors;
#                                             layouts that do not split and what --tp does not follow
#                                             yet are usage errors
#   launcher_tests.sh BUILD_DIR compute-shards [cpu|gpu]  --keep-compute-shards (bf16 copies kept, on GPUs
#                                             written by AdamW's kernel) trains as the casts do, a
#                                             resume with it follows the straight run; what it cannot
#                                             go with is a usage error
#   launcher_tests.sh BUILD_DIR grad-accum    --grad-accum 2 x --batch 2 (sync after the last or every
#                                             micro-batch) follows the losses of --batch 4
#   launcher_tests.sh BUILD_DIR overlap       2 GPUs, the 1B: all-gathers beside compute; the CPU no more
#                                             than prefetch depth + cap groups ahead (NCCL slowed);
#                                             without the cap further, reserved still near allocated
#   launcher_tests.sh BUILD_DIR data          token files (llm.c uint16/uint32, nanoGPT) train like the
#                                             same tokens as text; bad files are usage errors; the
#                                             evaluation set is the same on 1-3 ranks and does not
#                                             disturb training; the default log goes under runs/
#   launcher_tests.sh BUILD_DIR budget        --memory-budget on CPU ranks: profiles, calibrates, plans
#                                             and trains (also with --grad-accum 2, either sync); a budget below
#                                             every schedule is refused
#                                             with the smallest that fits (exit 2); the profile's cost
#                                             model written (--cost-model) and projected (--project)
#   launcher_tests.sh BUILD_DIR metrics       --tensorboard and --wandb (offline): TensorBoard's reader and
#                                             W&B's run file hold the logged steps; a python without the
#                                             writers is refused (exit 2)
#   launcher_tests.sh BUILD_DIR diverge [cpu|gpu]  --lr 1e8: the first non-finite step stops the run (exit 1),
#                                             nothing saved or exported after it; --max-skipped-steps
#                                             skips such steps without touching the state, then stops
#   launcher_tests.sh BUILD_DIR runs          checkpoints name their run: a fresh run into another run's
#                                             --save-dir is refused, --overwrite removes the old ones;
#                                             --resume of a checkpoint itself; a resume with nothing
#                                             to train is refused, or only exports with --export
#   launcher_tests.sh BUILD_DIR lineage       a run's checkpoints are its lineage's: --overwrite never
#                                             removes them; a resume from an older step sets the
#                                             abandoned branch aside; a resume with other --data or
#                                             --seed, or --stop-at-step not after it, is refused; an
#                                             --export over the save dir or the log is refused; a
#                                             damaged newest checkpoint names the next older one;
#                                             --keep-last keeps the lineage's newest N
#   launcher_tests.sh BUILD_DIR concurrent    a second run on a --save-dir or --log in use is
#                                             refused, naming the first
#   launcher_tests.sh BUILD_DIR rank-failures a program that cannot start: one line, exit 127; a rank
#                                             killed by a signal or exiting non-zero: one line naming
#                                             the rank; SIGTERM during start-up stops the ranks as asked
#   launcher_tests.sh BUILD_DIR signal TERM|INT|HUP [cpu|gpu]
#                                             the signal to fsdp-run mid-run reaches every rank (HUP as
#                                             TERM): all exit, fsdp-run exits 128+signal, nothing left
#                                             running (on GPUs: no process left on any GPU)
#   launcher_tests.sh BUILD_DIR keeps-files   no file a user named is lost: a log is never emptied
#                                             (a second run, the config read back, a run after kill -9
#                                             refused; a resume of its run appends, marked; a failed
#                                             resume leaves it), a run stopped by a signal exports
#                                             nothing (exit 3) and its requeued command exports, an
#                                             export that appears meanwhile is never replaced
set -u
build=$1 mode=$2
run="$build/fsdp-run" train="$build/fsdp-train"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

expect_usage_error() {  # expected message, then fsdp-run arguments
  local want=$1; shift
  "$run" "$@" >"$work/out" 2>&1
  local code=$?
  [ "$code" = 2 ] || fail "exit code $code, not 2, for: $*"$'\n'"$(cat "$work/out")"
  [ "$(wc -l <"$work/out")" = 1 ] || fail "not one line for: $*"$'\n'"$(cat "$work/out")"
  grep -qF -- "$want" "$work/out" || fail "no '$want' for: $*"$'\n'"$(cat "$work/out")"
  echo "ok ($*): $(cat "$work/out")"
}

case $mode in
train)
  steps=$3 checks=$4
  shift 4
  launch=()
  while [ "$1" != -- ]; do launch+=("$1"); shift; done
  shift
  "$run" "${launch[@]}" "$train" --steps "$steps" --log "$work/log.jsonl" "$@" || fail "the run failed"
  # shellcheck disable=SC2086  # CHECKS is a list of flags
  python3 "$(dirname "$0")/check_train_log.py" "$work/log.jsonl" --steps "$steps" $checks || fail "log check"
  ;;
resume)
  kind=${3:-cpu}
  if [ "$kind" = gpu ]; then
    n=$(nvidia-smi -L | wc -l); worlds="1 $n"; launch=(--gpu)
  else
    n=3; worlds="1 2 4"; launch=(--cpu)
  fi
  global=12  # sequences per step on any number of ranks
  common=(--model tiny --steps 20 --seq 32)
  "$run" "${launch[@]}" -n "$n" "$train" "${common[@]}" --batch $((global / n)) --save-dir "$work/straight" \
    --save-every 5 --async-save --log "$work/straight.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "straight run"; }
  grep -q "saved .*step-000015 (written in the background" "$work/out" || { cat "$work/out"; fail "no background save"; }
  "$run" "${launch[@]}" -n "$n" "$train" "${common[@]}" --batch $((global / n)) --stop-at-step 10 \
    --save-dir "$work/half" --log "$work/half.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "first half"; }
  [ -f "$work/half/step-000010/metadata.bin" ] || fail "no checkpoint at step 10"
  if [ "$kind" = cpu ]; then  # copied at step 10, written while steps 11-15 changed the state
    for f in "$work"/half/step-000010/shard-*; do
      cmp "$f" "$work/straight/step-000010/$(basename "$f")" || fail "the background save of step 10 differs"
    done
  fi
  # A resume must make the checkpoint's model: a run of another preset is told which.
  if "$run" "${launch[@]}" -n 1 "$train" --model small --steps 20 --seq 32 --resume "$work/half" >"$work/out" 2>&1 ||
     ! grep -q "holds the tiny model, this run makes the small model: pass --model tiny as its run did" "$work/out"; then
    cat "$work/out"; fail "a resume of another model was not refused by name"
  fi
  # Each world once (one GPU: 1 alone): a resumed run of the same lineage appends to its log.
  for w in $(printf '%s\n' $n $worlds | awk '!seen[$0]++'); do
    "$run" "${launch[@]}" -n "$w" "$train" "${common[@]}" --batch $((global / w)) --resume "$work/half" \
      --save-dir "$work/resumed-$w" --log "$work/resumed-$w.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "resume on $w"; }
    grep -q "resumed from .*step-000010 (step 10, run [0-9a-f]*)" "$work/out" || fail "did not say where it resumed"
    if [ "$w" = "$n" ] && [ "$kind" = cpu ]; then
      # The same ranks: the same arithmetic, so the same bits (CPU kernels are deterministic).
      # Shards only: metadata.bin also names the run, which differs (the resumed run is the half run).
      for f in "$work"/straight/step-000020/shard-*; do
        cmp "$f" "$work/resumed-$w/step-000020/$(basename "$f")" || fail "$(basename "$f") differs from the straight run"
      done
      tolerance=0
    else
      # Another rank count sums in another order: tests/lib/helpers.h's bound for this model and batch
      # (2 * 10 * sqrt(44 * 384) * 2^-24 = 1.6e-4 per step), over the ten steps after the resume.
      # On GPUs the same rank count is not bit-exact either (atomics in backward kernels).
      tolerance=1.6e-3
    fi
    python3 "$(dirname "$0")/check_train_log.py" "$work/resumed-$w.jsonl" --first-step 11 --steps 20 \
      --same-loss-as "$work/straight.jsonl" --loss-tolerance $tolerance || fail "resumed on $w ranks"
  done
  echo "resume: ok"
  ;;
overlap)
  # The overlap's regression test, on 2 GPUs: fsdp-train's 1B traced over steps 2-3 (bench/trace_overlap.py
  # reads the trace). (1) NCCL as it comes: the all-gathers run beside the blocks' compute (95% of
  # their time on 4 H100s). NCCL held to one channel, so each all-gather outlasts its block and the GPU
  # falls 200 ms a step behind the CPU: (2) with the all-gather cap (2, the default) the CPU never has
  # compute of more than prefetch depth + cap groups issued that the GPU has not started; (3) without
  # it the CPU runs further ahead (so (2) can fail), and reserved memory still stays within 5% of the
  # allocated peak: the gathered buffers are reused in stream order, the cap is not what bounds them.
  bench="$(dirname "$0")/../../bench"
  slow=(env NCCL_MAX_NCHANNELS=1 NCCL_MIN_NCHANNELS=1 NCCL_PROTO=Simple)  # run_bench.py's SLOW_NCCL
  depth=1 cap=2  # the defaults, named so that the bound below follows them
  one=(--model 1b --seq 2048 --batch 2 --param-dtype bf16 --reduce-dtype fp32 --steps 5 --trace-steps 2
    --prefetch-depth $depth)
  for run_name in plain slow slow-nolimit; do
    extra=(--max-inflight-allgathers $cap) launch=()
    [ "$run_name" != plain ] && launch=("${slow[@]}")
    [ "$run_name" = slow-nolimit ] && extra=(--max-inflight-allgathers 0)
    "${launch[@]}" "$run" --gpu -n 2 "$train" "${one[@]}" "${extra[@]}" --log "$work/$run_name.jsonl" \
      --trace "$work/$run_name" >"$work/out" 2>&1 || { cat "$work/out"; fail "the $run_name run"; }
    python3 "$bench/trace_overlap.py" "$work/$run_name-rank0.json" --json "$work/$run_name-trace.json" \
      || fail "reading the $run_name trace"
  done
  python3 - "$work" $((depth + cap)) <<'PY' || fail "overlap"
import json, sys
work, bound = sys.argv[1], int(sys.argv[2])  # prefetch depth + all-gather cap
trace = lambda name: json.load(open(f"{work}/{name}-trace.json"))[0]
plain, capped, uncapped = trace("plain"), trace("slow"), trace("slow-nolimit")
beside = plain["allgather_beside_compute_ms"] / plain["allgather_ms"]
print(f"overlap: all-gathers {beside:.0%} beside compute; groups ahead of the GPU, capped "
      f"{capped['groups_ahead_max']}, uncapped {uncapped['groups_ahead_max']}")
assert beside >= 0.8, "the all-gathers no longer run beside compute"
assert capped["groups_ahead_max"] <= bound, f"the CPU ran more than {bound} groups ahead under the cap"
assert uncapped["groups_ahead_max"] > bound, "without the cap the CPU did not run ahead: the test shows nothing"
rows = [json.loads(line) for line in open(f"{work}/slow-nolimit.jsonl")]
ratio = max(r["peak_reserved_gib"] for r in rows) / max(r["peak_alloc_gib"] for r in rows)
print(f"overlap: reserved / allocated without the cap {ratio:.3f}")
assert ratio <= 1.05, "without the cap reserved memory grew past 1.05x the allocated peak"
PY
  echo "overlap: ok"
  ;;
tp)
  # same_tensors A B BOUND: the safetensors files (or directories of them) A and B hold the same
  # float32 tensors, each difference's norm within BOUND times the tensor's norm.
  same_tensors() {
    python3 - "$@" <<'PY'
import array, glob, json, os, struct, sys
def tensors(path):
    out = {}
    for name in sorted(glob.glob(f"{path}/*.safetensors")) if os.path.isdir(path) else [path]:
        data = open(name, "rb").read()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        for key, t in header.items():
            assert t["dtype"] == "F32", t
            a, b = t["data_offsets"]
            out[key] = (t["shape"], array.array("f", data[8 + n + a:8 + n + b]))
    return out
one, other, bound = tensors(sys.argv[1]), tensors(sys.argv[2]), float(sys.argv[3])
assert one and one.keys() == other.keys(), (sorted(one), sorted(other))
worst = 0.0
for key, (shape, values) in one.items():
    assert other[key][0] == shape, f"{key}: shapes {shape} and {other[key][0]}"
    norm = sum(x * x for x in values) ** 0.5 or 1.0
    worst = max(worst, sum((x - y) ** 2 for x, y in zip(values, other[key][1])) ** 0.5 / norm)
assert worst < bound, f"a difference of {worst:.3g} of its tensor's norm, over {bound}"
print(f"{len(one)} tensors alike, the largest difference {worst:.2g} of its tensor's norm: ok")
PY
  }
  text="$(dirname "$0")/../../README.md"
  common=(--model tiny --steps 3 --seq 32 --clip 1.0 --eval-data "$text")
  # A global batch of 8 rows (one process: two micro-batches of 4) and 8 held-out rows everywhere.
  for extra in "" "--tie-embeddings --recompute"; do
    tag=${extra:+-tied}
    "$run" -n 1 --cpu "$train" "${common[@]}" $extra --batch 4 --grad-accum 2 --eval-batches 2 --log "$work/one$tag.jsonl" \
      --export "$work/one$tag.safetensors" >"$work/out" 2>&1 || { cat "$work/out"; fail "one process $extra"; }
    for layout in "2 --batch 4 --grad-accum 2 --eval-batches 2 --tp 2" "4 --batch 4 --eval-batches 2 --tp 2" \
                  "8 --batch 2 --eval-batches 4 --replicas 2 --tp 2"; do
      set -- $layout
      n=$1; shift
      name="n$n$tag"
      "$run" -n "$n" --cpu "$train" "${common[@]}" $extra "$@" --log "$work/$name.jsonl" \
        --export "$work/$name.safetensors" >"$work/out" 2>&1 || { cat "$work/out"; fail "$n ranks: $* $extra"; }
      grep -q "x 32 tokens per tp group .* tensor parallel: 2 ranks a layer" "$work/out" || { cat "$work/out"; fail "no tp in the banner"; }
      # The same sums in another order (tests/lib/helpers.h's bound, 1.6e-4 a step, as grad-accum).
      python3 "$(dirname "$0")/check_train_log.py" "$work/$name.jsonl" --steps 3 \
        --same-loss-as "$work/one$tag.jsonl" --loss-tolerance 4.8e-4 || fail "$n ranks: $* $extra"
      # Three AdamW steps move each weight by up to the sum of their learning rates (3.6e-3, a
      # tenth of the weights' largest, ~0.05), a wrong gradient moves many elsewhere by as much:
      # a difference of 1e-2 or more of a tensor's norm. Float32 sums in another order differ by
      # ~1e-7 a gradient, except where a gradient is near zero by cancellation: AdamW's first
      # steps, about sign(gradient) x lr, may then move that one element differently (measured:
      # 1.1e-5 on one element of 11264, 1e-5 of the tensor's norm).
      same_tensors "$work/one$tag.safetensors" "$work/$name.safetensors" 1e-4 || fail "$n ranks: $* $extra: exported weights"
    done
  done
  # Hugging Face weights (the one-process run's trained export) read into the parts: the same steps.
  from=(--model tiny --steps 3 --seq 32 --clip 1.0 --init-from "$work/one.safetensors")
  "$run" -n 1 --cpu "$train" "${from[@]}" --batch 8 --log "$work/from-one.jsonl" >"$work/out" 2>&1 \
    || { cat "$work/out"; fail "one process --init-from"; }
  "$run" -n 4 --cpu "$train" "${from[@]}" --batch 4 --tp 2 --log "$work/from-tp.jsonl" >"$work/out" 2>&1 \
    || { cat "$work/out"; fail "--tp 2 --init-from"; }
  python3 "$(dirname "$0")/check_train_log.py" "$work/from-tp.jsonl" --steps 3 \
    --same-loss-as "$work/from-one.jsonl" --loss-tolerance 4.8e-4 || fail "--tp 2 --init-from"
  # The runtime's other modes under tp: offloaded with the optimizer in backward, buckets with
  # parameters kept gathered.
  plain=(--model tiny --steps 3 --seq 32 --clip 0)
  "$run" -n 1 --cpu "$train" "${plain[@]}" --batch 8 --log "$work/plain.jsonl" >/dev/null 2>&1 || fail "clip 0"
  for modes in "--cpu-offload --optimizer-in-backward" "--bucket-mb 1 --no-reshard-after-forward"; do
    "$run" -n 4 --cpu "$train" "${plain[@]}" --batch 4 --tp 2 $modes --log "$work/modes.jsonl" --overwrite-log \
      >"$work/out" 2>&1 || { cat "$work/out"; fail "--tp 2 $modes"; }
    python3 "$(dirname "$0")/check_train_log.py" "$work/modes.jsonl" --steps 3 \
      --same-loss-as "$work/plain.jsonl" --loss-tolerance 4.8e-4 || fail "--tp 2 $modes"
  done
  # Planned under tp: the profile prices the tp collectives as the groups' compute; the smallest
  # budget that fits (as the planner names it) makes the plan recompute, on the same losses.
  planned=(--model tiny --steps 8 --seq 32 --clip 0)
  "$run" -n 1 --cpu "$train" "${planned[@]}" --batch 8 --log "$work/unplanned.jsonl" >/dev/null 2>&1 || fail "8 steps"
  "$run" -n 4 --cpu "$train" "${planned[@]}" --batch 4 --tp 2 --memory-budget 0.0001 >"$work/out" 2>&1
  least=$(sed -n 's/.*the smallest budget that fits is \([0-9.]*\) MiB.*/\1/p' "$work/out" | head -1)
  [ -n "$least" ] || { cat "$work/out"; fail "--tp 2: no smallest budget named"; }
  "$run" -n 4 --cpu "$train" "${planned[@]}" --batch 4 --tp 2 --log "$work/planned.jsonl" --cost-model "$work/tp-cost.json" \
    --memory-budget "$(python3 -c "print(($least + 0.05) / 1024)")" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "--tp 2 --memory-budget"; }
  grep -q "fsdp-train: plan for a .* budget .*: recompute [1-9]" "$work/out" || { cat "$work/out"; fail "no recompute planned"; }
  python3 "$(dirname "$0")/check_train_log.py" "$work/planned.jsonl" --steps 8 \
    --same-loss-as "$work/unplanned.jsonl" --loss-tolerance 4.8e-4 || fail "--tp 2 --memory-budget"
  # A projection starts from a profile without tp (its tp collectives are in the compute).
  "$train" --project "$work/tp-cost.json" >"$work/out" 2>&1 && fail "--project took a profile measured under --tp"
  grep -qF "was measured with --tp 2, and a projection starts from a profile without" "$work/out" ||
    { cat "$work/out"; fail "no refusal of a tp profile"; }
  # Checkpoints: saved at dp 2 x tp 2 (step 2 in the background) and at dp 2 without tp, each
  # resumed on other layouts, follow the straight run; both hold the same tensors (the optimizer's
  # moments too), read whole by the offline converter.
  ck=(--model tiny --steps 6 --seq 32 --clip 1.0)
  "$run" -n 1 --cpu "$train" "${ck[@]}" --batch 8 --log "$work/straight.jsonl" >/dev/null 2>&1 || fail "straight"
  "$run" -n 4 --cpu "$train" "${ck[@]}" --batch 4 --tp 2 --stop-at-step 3 --save-every 2 --async-save \
    --save-dir "$work/ck-tp" --log "$work/ck-tp.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "save at tp 2"; }
  "$run" -n 2 --cpu "$train" "${ck[@]}" --batch 4 --stop-at-step 3 --save-dir "$work/ck-dp" \
    --log "$work/ck-dp.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "save at dp 2"; }
  for resume in "ck-tp 1 --batch 8" "ck-tp 2 --batch 4" "ck-tp 8 --batch 2 --replicas 2 --tp 2" \
                "ck-tp 4 --batch 8 --tp 4" "ck-dp 4 --batch 4 --tp 2"; do
    set -- $resume
    from=$1 n=$2; shift 2
    "$run" -n "$n" --cpu "$train" "${ck[@]}" "$@" --resume "$work/$from" --log "$work/resumed.jsonl" \
      --overwrite-log >"$work/out" 2>&1 || { cat "$work/out"; fail "resume $resume"; }
    python3 "$(dirname "$0")/check_train_log.py" "$work/resumed.jsonl" --steps 6 --first-step 4 \
      --same-loss-as "$work/straight.jsonl" --loss-tolerance 4.8e-4 || fail "resume $resume"
  done
  for from in ck-tp ck-dp; do
    PYTHONPATH="$build/py" "$build/python" -m fsdpcpp.convert --to torch --with-optimizer --dtype keep \
      "$work/$from" "$work/$from.pt" >"$work/out" 2>&1 || { cat "$work/out"; fail "convert $from"; }
  done
  "$build/python" - "$work/ck-tp.pt" "$work/ck-dp.pt" <<'PY' || fail "the tp checkpoint's tensors"
import sys, torch
def flat(d, prefix=""):  # {"model": {...}, "optimizer": {...}} -> one level of tensors
    out = {}
    for key, value in d.items():
        out.update(flat(value, f"{prefix}{key}/") if isinstance(value, dict) else {prefix + key: value})
    return out
tp, dp = (flat(torch.load(path)) for path in sys.argv[1:])
tp = {k: v for k, v in tp.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
dp = {k: v for k, v in dp.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
assert tp.keys() == dp.keys() and len(tp) > 40, (sorted(tp), sorted(dp))  # weights and both AdamW moments
worst = max(((tp[k] - dp[k]).abs().max() / dp[k].abs().max().clamp_min(1e-30)).item() for k in tp)
assert worst < 1e-4, f"largest difference {worst:.3g} of a tensor's largest magnitude"
print(f"{len(tp)} tensors alike, largest difference {worst:.2g} of a tensor's largest magnitude: ok")
PY
  expect_usage_error "--tp 3 does not divide the 4 ranks of a replica" -n 4 --cpu "$train" --model tiny --tp 3
  expect_usage_error "model's 4 key/value heads do not split over 8 ranks" -n 8 --cpu "$train" --model tiny --tp 8
  echo "tp: ok"
  ;;
compute-shards)
  # On CPU ranks the same arithmetic, so the same bits; on GPUs atomics in backward kernels make
  # no two runs bit-exact (the resume test's bound, tests/lib/helpers.h's for this model, a step).
  if [ "${3:-cpu}" = gpu ]; then launch=(--gpu -n "$(nvidia-smi -L | wc -l)") tolerance=1.6e-3
  else launch=(--cpu -n 2) tolerance=0; fi
  common=(--model tiny --steps 8 --seq 32 --param-dtype bf16)
  "$run" "${launch[@]}" "$train" "${common[@]}" --log "$work/cast.jsonl" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "without --keep-compute-shards"; }
  "$run" "${launch[@]}" "$train" "${common[@]}" --keep-compute-shards --log "$work/kept.jsonl" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "--keep-compute-shards"; }
  grep -q " | compute shards kept" "$work/out" || { cat "$work/out"; fail "the banner does not say so"; }
  python3 "$(dirname "$0")/check_train_log.py" "$work/kept.jsonl" --steps 8 --same-loss-as "$work/cast.jsonl" \
    --loss-tolerance $tolerance || fail "--keep-compute-shards trains otherwise"
  # The load writes the masters (its version counters move): the copies are made again from them.
  "$run" "${launch[@]}" "$train" "${common[@]}" --keep-compute-shards --stop-at-step 4 --save-dir "$work/ck" \
    >"$work/out" 2>&1 || { cat "$work/out"; fail "save with --keep-compute-shards"; }
  "$run" "${launch[@]}" "$train" "${common[@]}" --keep-compute-shards --resume "$work/ck" \
    --log "$work/resumed.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "resume with --keep-compute-shards"; }
  python3 "$(dirname "$0")/check_train_log.py" "$work/resumed.jsonl" --first-step 5 --steps 8 \
    --same-loss-as "$work/kept.jsonl" --loss-tolerance $tolerance || fail "the resume with --keep-compute-shards"
  expect_usage_error "--keep-compute-shards keeps bf16 copies of the shards on the GPU, and --cpu-offload" \
    -n 1 --cpu "$train" --model tiny --keep-compute-shards --cpu-offload
  expect_usage_error "drop --keep-compute-shards" -n 1 --cpu "$train" --model tiny --keep-compute-shards \
    --memory-budget 1
  echo "compute-shards: ok"
  ;;
grad-accum)
  common=(--model tiny --steps 3 --seq 32)
  "$run" -n 2 --cpu "$train" "${common[@]}" --batch 4 --log "$work/one.jsonl" >"$work/out" 2>&1 \
    || { cat "$work/out"; fail "--batch 4"; }
  for sync in last every; do
    "$run" -n 2 --cpu "$train" "${common[@]}" --batch 2 --grad-accum 2 --grad-accum-sync $sync \
      --log "$work/$sync.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "--grad-accum-sync $sync"; }
    grep -q "batch 2 x 2 x 32 tokens per rank" "$work/out" || fail "the banner does not show the micro-batches"
    # Each step sums the same gradients in another order: tests/lib/helpers.h's bound for this model
    # and batch, 1.6e-4 per step (see resume), over three steps.
    python3 "$(dirname "$0")/check_train_log.py" "$work/$sync.jsonl" --steps 3 \
      --same-loss-as "$work/one.jsonl" --loss-tolerance 4.8e-4 || fail "--grad-accum-sync $sync"
  done
  echo "grad-accum: ok"
  ;;
data)
  text="$(dirname "$0")/../../README.md"
  python3 - "$text" "$work" <<'PY' || fail "writing token files"
import struct, sys
ids = list(open(sys.argv[1], "rb").read())
def write(name, magic, fmt, tokens):
    with open(f"{sys.argv[2]}/{name}", "wb") as f:
        if magic:
            f.write(struct.pack("<256i", magic, 1, len(tokens), *[0] * 253))
        f.write(struct.pack(f"<{len(tokens)}{fmt}", *tokens))
write("llmc16.bin", 20240520, "H", ids)
write("llmc32.bin", 20240801, "I", ids)
write("nanogpt.bin", 0, "H", ids)
write("big-id.bin", 20240520, "H", ids[:-1] + [300])
write("eval.bin", 20240520, "H", ids[::-1])
with open(f"{sys.argv[2]}/truncated.bin", "wb") as f:
    f.write(open(f"{sys.argv[2]}/llmc16.bin", "rb").read()[:-2])
PY
  common=(--model tiny --steps 3 --seq 32 --batch 2)
  "$run" -n 2 --cpu "$train" "${common[@]}" --data "$text" --log "$work/text.jsonl" >/dev/null 2>&1 || fail "text"
  for f in llmc16 llmc32 nanogpt; do
    "$run" -n 2 --cpu "$train" "${common[@]}" --data "$work/$f.bin" --log "$work/$f.jsonl" >"$work/out" 2>&1 \
      || { cat "$work/out"; fail "$f.bin"; }
    # The same token ids as the text file, rows drawn from the same positions: the same bits.
    python3 "$(dirname "$0")/check_train_log.py" "$work/$f.jsonl" --steps 3 --same-loss-as "$work/text.jsonl" \
      || fail "$f.bin does not train like the text"
  done
  # A directory of token files is one corpus: the directory holding only llmc16.bin trains as the file.
  mkdir -p "$work/corpus" && cp "$work/llmc16.bin" "$work/corpus/000000.bin"
  "$run" -n 2 --cpu "$train" "${common[@]}" --data "$work/corpus" --log "$work/corpus.jsonl" >"$work/out" 2>&1 \
    || { cat "$work/out"; fail "a directory of token files"; }
  python3 "$(dirname "$0")/check_train_log.py" "$work/corpus.jsonl" --steps 3 --same-loss-as "$work/llmc16.jsonl" \
    || fail "the directory does not train as its one file"
  # Documents packed in a row (here each line of README.md, ended by '\n', id 10) attend only within
  # themselves: another loss than causal attention's from step 1, and the same on 2 ranks as on 4
  # with tensor parallelism (the mask made from each tp group's tokens; summation order: 4.8e-4
  # over three steps, as grad-accum).
  block=(--attention-mask block_causal --eos-id 10 --data "$work/llmc16.bin")
  "$run" -n 2 --cpu "$train" "${common[@]}" "${block[@]}" --log "$work/block.jsonl" >"$work/out" 2>&1 \
    || { cat "$work/out"; fail "block_causal"; }
  "$run" -n 4 --cpu "$train" "${common[@]}" "${block[@]}" --tp 2 --log "$work/block-tp.jsonl" >"$work/out" 2>&1 \
    || { cat "$work/out"; fail "block_causal with tp"; }
  python3 "$(dirname "$0")/check_train_log.py" "$work/block-tp.jsonl" --steps 3 --same-loss-as "$work/block.jsonl" \
    --loss-tolerance 4.8e-4 || fail "block_causal under tp differs"
  if python3 "$(dirname "$0")/check_train_log.py" "$work/block.jsonl" --steps 3 --same-loss-as "$work/llmc16.jsonl" \
    --loss-tolerance 1e-4 >/dev/null; then fail "block_causal trains as causal attention"; fi
  # Resumed, the data goes on at the sample after the checkpoint's: on the same layout the losses of
  # the straight run bit for bit; with half the global batch (1 rank of 2 rows, not 2 of 2) the
  # log's position counts on from the checkpoint's 3 x 4 samples, 2 a step.
  resume_common=(--model tiny --steps 6 --seq 32 --batch 2 --data "$work/llmc16.bin")
  "$run" -n 2 --cpu "$train" "${resume_common[@]}" --log "$work/straight.jsonl" >/dev/null 2>&1 || fail "straight"
  "$run" -n 2 --cpu "$train" "${resume_common[@]}" --stop-at-step 3 --save-dir "$work/data-ck" \
    --log "$work/first-half.jsonl" >/dev/null 2>&1 || fail "first half"
  "$run" -n 2 --cpu "$train" "${resume_common[@]}" --resume "$work/data-ck" --log "$work/second-half.jsonl" \
    >"$work/out" 2>&1 || { cat "$work/out"; fail "resume on the data file"; }
  python3 "$(dirname "$0")/check_train_log.py" "$work/second-half.jsonl" --first-step 4 --steps 6 \
    --same-loss-as "$work/straight.jsonl" || fail "the resumed run read other samples than the straight run"
  "$run" -n 1 --cpu "$train" "${resume_common[@]}" --resume "$work/data-ck" --log "$work/half-batch.jsonl" \
    >"$work/out" 2>&1 || { cat "$work/out"; fail "resume with half the global batch"; }
  python3 - "$work" "$(dirname "$0")/../../README.md" <<'PY' || fail "the data position"
import json, os, sys
work, text = sys.argv[1:]
windows = (os.path.getsize(text) - 1) // 32  # --seq 32: each window starts where the last ended
for name, first, per_step in (("straight", 1, 4), ("half-batch", 4, 2)):
    rows = [json.loads(line) for line in open(f"{work}/{name}.jsonl")]
    expected = [(12 if name == "half-batch" else 0) + per_step * (r["step"] - first + 1) for r in rows]
    got = [r["samples"] for r in rows]
    assert got == expected, f"{name}: samples {got}, expected {expected}"
    for r in rows:
        assert abs(r["epoch"] - r["samples"] / windows) < 1e-12, f"{name}: epoch {r['epoch']} of {windows} windows"
print("data position: ok")
PY
  expect_usage_error "holds token id 300 (llm.c uint16) but the tiny model's vocabulary has 256 ids" \
    -n 2 --cpu "$train" --data "$work/big-id.bin"
  expect_usage_error "its llm.c header says" -n 2 --cpu "$train" --data "$work/truncated.bin"
  expect_usage_error "--eval-data: cannot read '/nonexistent'" -n 2 --cpu "$train" --eval-data /nonexistent
  # Evaluation must not change training: the same losses, bit for bit, with and without it.
  "$run" -n 2 --cpu "$train" "${common[@]}" --data "$work/llmc16.bin" --eval-data "$work/eval.bin" --eval-every 1 \
    --log "$work/with-eval.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "training with evaluation"; }
  grep -q "eval after step 3 | loss [0-9.]* | perplexity" "$work/out" || fail "no evaluation line"
  python3 "$(dirname "$0")/check_train_log.py" "$work/with-eval.jsonl" --steps 3 \
    --same-loss-as "$work/llmc16.jsonl" || fail "evaluation changed training"
  # The evaluation set does not depend on the rank count. With a learning rate of 1e-12 the model
  # stays the initial one (changes of order 1e-12), and the evaluation sums in float64 whatever
  # rows each rank holds: the losses agree to float32 forward rounding of one row, far below 1e-6.
  for w in 1 2 3; do
    "$run" -n $w --cpu "$train" --model tiny --steps 1 --seq 32 --batch 2 --lr 1e-12 --min-lr 0 \
      --eval-data "$work/eval.bin" --eval-batches 5 --log "$work/eval-$w.jsonl" >/dev/null 2>&1 || fail "eval on $w"
  done
  python3 - "$work" <<'PY' || fail "evaluation differs across rank counts"
import json, sys
losses = [json.loads(open(f"{sys.argv[1]}/eval-{w}.jsonl").readline())["eval_loss"] for w in (1, 2, 3)]
print("eval loss on 1, 2, 3 ranks:", losses)
sys.exit(0 if max(losses) - min(losses) <= 1e-6 * losses[0] else 1)
PY
  # No --log: the log goes into a new runs/<date-time>/ under the working directory.
  (cd "$work" && "$run" -n 1 --cpu "$train" --steps 1 --seq 16 >out 2>&1) || fail "default log"
  ls "$work"/runs/*/fsdp-train.jsonl >/dev/null 2>&1 || fail "no log under runs/"
  grep -q "log in runs/.*/fsdp-train.jsonl" "$work/out" || fail "the log's place is not printed"
  echo "data: ok"
  ;;
killed-save)
  for async in "" --async-save; do
    ck="$work/ck$async"
    "$run" -n 2 --cpu "$train" --model tiny --steps 100000 --seq 32 --save-every 1 $async --save-dir "$ck" \
      --log "$work/log$async.jsonl" >"$work/out" 2>&1 &
    pid=$!
    for _ in $(seq 600); do grep -q "step   15/" "$work/out" && break; sleep 0.1; done
    rank1=$(pgrep -f -- "--save-dir $ck" | while read -r p; do
      grep -qz '^OMPI_COMM_WORLD_RANK=1$' "/proc/$p/environ" 2>/dev/null && echo "$p"; done | head -1)
    [ -n "$rank1" ] || fail "rank 1 not found"
    kill -9 "$rank1"
    wait "$pid"
    echo "killed rank 1 (pid $rank1) with SIGKILL${async:+ (}$async${async:+)}; left: $(ls "$ck" | tr '\n' ' ')"
    newest=$(ls "$ck" | grep -v tmp | sort | tail -1)
    "$run" -n 2 --cpu "$train" --model tiny --steps $(( 10#${newest#step-} + 2 )) --seq 32 --resume "$ck" \
      --log "$work/resumed$async.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "resume after the kill"; }
    grep "resumed from" "$work/out"
  done
  echo "killed save: ok"
  ;;
signal-save)
  "$run" -n 2 --cpu "$train" --model tiny --steps 100000 --seq 32 --save-dir "$work/ck" --log "$work/log.jsonl" \
    >"$work/out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q "step    3/" "$work/out" && break; sleep 0.1; done
  kill -TERM "$pid"
  wait "$pid"
  code=$?
  tail -3 "$work/out"
  [ "$code" = 3 ] || fail "fsdp-run exited $code, not 3 (stopped, resumable), after the ranks saved"
  grep -q "stopped after step [0-9]* (a signal)" "$work/out" || fail "no stop message"
  [ -n "$(ls "$work"/ck/step-*/metadata.bin 2>/dev/null)" ] || fail "nothing saved"
  "$run" -n 2 --cpu "$train" --model tiny --steps 100000 --stop-at-step 100000 --seq 32 --resume "$work/ck" \
    --save-dir "$work/ck" --log "$work/resumed.jsonl" --dry-run >/dev/null 2>&1 || fail "the checkpoint is not resumable"
  echo "signal save: ok"
  ;;
usage)
  short="$work/short.txt"; printf 'too short' >"$short"
  expect_usage_error "--steps: 'abc' is not an integer" -n 2 --cpu "$train" --steps abc
  expect_usage_error "unknown flag '--bogus'" -n 2 --cpu "$train" --bogus
  expect_usage_error "--data: cannot read '/nonexistent'" -n 2 --cpu "$train" --data /nonexistent
  expect_usage_error "holds 0 sequence(s) of --seq 128 + 1 tokens" -n 2 --cpu "$train" --data "$short"
  expect_usage_error "--log: cannot write '/proc/x/y'" -n 2 --cpu "$train" --log /proc/x/y
  expect_usage_error "-n must be a whole number of ranks, at least 1" -n 0 "$train"
  expect_usage_error "-n must be a whole number of ranks, at least 1" -n two "$train"
  expect_usage_error "--port must be a TCP port" --port 70000 --gpu -n 1 "$train"
  expect_usage_error "--steps is given twice: give it once" -n 2 --cpu "$train" --steps 5 --steps 6
  expect_usage_error "--timeout must be 0 (default) or from 0.001 seconds" -n 2 --cpu "$train" --timeout 0.0001
  echo "usage errors: ok"
  ;;
write-fails)
  # The log cannot be written from the first line: the next step is saved, then the run stops.
  "$train" --steps 5 --seq 16 --log /dev/full --save-dir "$work/ck" >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 1 ] || fail "exit code $code, not 1"
  grep -q "fsdp-train: error: cannot write '/dev/full': No space left on device" "$work/out" || fail "no error message"
  grep -q "stopped after step 2 (the log cannot be written)" "$work/out" || fail "no stop at the next step"
  [ -f "$work/ck/step-000002/metadata.bin" ] || fail "the work was not saved"
  ! grep -q "done" "$work/out" || fail "claims success"
  # Over `ulimit -f` (8 MiB: MPI's own files need about 4): an error naming the file, not a rank
  # killed by SIGXFSZ. The small model's initial weights take about 130 MB.
  (ulimit -f 8192; "$train" --model small --steps 1 --seq 16 --batch 1 --save-init "$work/init.pt" \
    --log "$work/big.jsonl" >"$work/out" 2>&1)
  code=$?
  cat "$work/out"
  [ "$code" = 1 ] || fail "exit code $code, not 1, over the file size limit"
  grep -q "cannot write '$work/init.pt': File too large" "$work/out" || fail "no error naming the file"
  echo "write failure: ok"
  ;;
signal)
  sig=$3 kind=${4:-cpu}
  marker="$work/signal-run"  # in every rank's command line, to find leftovers
  if [ "$kind" = gpu ]; then launch=(--gpu); else launch=(-n 2 --cpu); fi
  "$run" "${launch[@]}" "$train" --model tiny --steps 100000 --seq 32 --log "$marker.jsonl" >"$work/out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q "step    2/" "$work/out" && break; sleep 0.1; done
  grep -q "step    2/" "$work/out" || { cat "$work/out"; fail "training never started"; }
  ranks=$(pgrep -f -- "--log $marker.jsonl" | grep -v "^$pid\$" | wc -l)
  kill -s "$sig" "$pid"
  wait "$pid"
  code=$?
  tail -3 "$work/out"
  want=$([ "$sig" = INT ] && echo 130 || echo 143)  # HUP: a stop request, as TERM
  [ "$code" = "$want" ] || fail "fsdp-run exited $code, not $want"
  sleep 0.5
  left=$(pgrep -f -- "--log $marker.jsonl" | wc -l)
  [ "$left" = 0 ] || fail "$left process(es) still running: $(pgrep -af -- "--log $marker.jsonl")"
  if [ "$kind" = gpu ]; then
    apps=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader)
    [ -z "$apps" ] || fail "processes still hold GPU memory: $apps"
  fi
  echo "SIG$sig: fsdp-run exited $code, $ranks process(es) under it all gone: ok"
  ;;
metrics)
  # --tensorboard and --wandb in one run: TensorBoard's own reader finds each step's loss and learning
  # rate as logged; so does the offline W&B run's file, with the run's id as its name and the flags
  # given as its config. W&B's half needs wandb in the build's python (scripts/setup.sh installs it;
  # the GPU machines' image has none).
  wandb=(--wandb fsdp-test) wrote="TensorBoard in $work/tb, W&B project fsdp-test"
  if ! "$build/python" -c 'import wandb' 2>/dev/null; then
    wandb=() wrote="TensorBoard in $work/tb"
    echo "metrics: $build/python has no wandb: the W&B half is not run (scripts/setup.sh installs it)"
  fi
  WANDB_MODE=offline WANDB_DIR="$work" WANDB_SILENT=true "$run" -n 2 --cpu "$train" --model tiny --seq 32 --steps 4 \
    --log "$work/log.jsonl" --tensorboard "$work/tb" "${wandb[@]}" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "the run with --tensorboard ${wandb[*]} failed"; }
  grep -qF "$wrote" "$work/out" || { cat "$work/out"; fail "no '$wrote'"; }
  "$build/python" - "$work/log.jsonl" "$work" "${#wandb[@]}" <<'PY' || fail "the metrics files do not hold the logged steps"
import glob, json, struct, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
logged = [json.loads(line) for line in open(sys.argv[1])]
want = {key: [(r["step"], r[key]) for r in logged] for key in ("loss", "lr")}
def same(got, want):
    return len(got) == 4 and all(a == c and abs(b - d) <= 1e-6 * abs(d) for (a, b), (c, d) in zip(got, want))
events = EventAccumulator(sys.argv[2] + "/tb").Reload()
for key in want:
    got = [(e.step, e.value) for e in events.Scalars("train/" + key)]
    assert same(got, want[key]), ("tensorboard", key, got, want[key])
assert "perf/tflops_per_gpu" in events.Tags()["scalars"], events.Tags()
if sys.argv[3] == "0":
    sys.exit(0)
# W&B's run file: a 7-byte header, then LevelDB-log records in 32 KiB blocks (a 4-byte checksum, a
# 2-byte length and a 1-byte type before each piece; type 1 a whole record, 4 a split one's last).
from wandb.proto import wandb_internal_pb2
path, = glob.glob(sys.argv[2] + "/wandb/offline-run-*/run-*.wandb")
data, records, piece, pos = open(path, "rb").read(), [], b"", 7
while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:
        pos += 32768 - pos % 32768
        continue
    length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
    piece, pos = piece + data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind in (1, 4):
        records.append(wandb_internal_pb2.Record.FromString(piece))
        piece = b""
history = [(r.history.step.num, {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
           for r in records if r.HasField("history")]
for key in want:
    got = [(step, items["train/" + key]) for step, items in history]
    assert same(got, want[key]), ("wandb", key, got, want[key])
run, = [r.run for r in records if r.HasField("run")]
config = {u.key: json.loads(u.value_json) for u in run.config.update}
assert run.project == "fsdp-test" and run.display_name, (run.project, run.display_name)  # named by the run's id
assert config.get("model") == "tiny" and config.get("steps") == "4", config  # the flags as given
PY
  # A python without the writers is refused before the run starts.
  for flag in --tensorboard --wandb; do
    FSDP_PYTHON=/bin/false "$run" -n 2 --cpu "$train" --model tiny --seq 32 --steps 2 "$flag" "$work/other" \
      >"$work/out" 2>&1
    code=$?
    [ "$code" = 2 ] && grep -qF -- "$flag: " "$work/out" || { cat "$work/out"; fail "$flag: exit $code, no refusal"; }
  done
  echo "TensorBoard events${wandb:+ and the W&B run} hold the logged steps; a python without the writers refused: ok"
  ;;
budget)
  common=(-n 2 --cpu "$train" --model tiny --seq 32)
  "$run" "${common[@]}" --steps 10 --memory-budget 1 --cost-model "$work/cost.json" --log "$work/log.jsonl" \
    >"$work/out" 2>&1 || { cat "$work/out"; fail "the planned run failed"; }
  python3 "$(dirname "$0")/check_train_log.py" "$work/log.jsonl" --steps 10 --loss-falls || fail "log check"
  for want in "fsdp-train: profiled step:" "fsdp-train: calibration step" "fsdp-train: plan for a 1.00 GiB budget" \
    "fsdp-train:   predicted"; do
    grep -qF -- "$want" "$work/out" || { cat "$work/out"; fail "no '$want'"; }
  done
  # The profile, projected to more ranks than it ran on: FSDP rows, and HSDP where the world spans hosts.
  "$train" --project "$work/cost.json" --project-worlds 2,8 --gpus-per-host 4 >"$work/projected" 2>&1 ||
    { cat "$work/projected"; fail "--project failed"; }
  for want in "measured on 2 ranks" "     2  FSDP" "     8  FSDP" "     8  HSDP 2x4"; do
    grep -qF -- "$want" "$work/projected" || { cat "$work/projected"; fail "no '$want' in the projection"; }
  done
  # Times tensor parallelism (the tiny model's shapes, the tokens the file records), and the
  # planner's layout and schedule for a budget, per world.
  "$train" --project "$work/cost.json" --project-worlds 8 --gpus-per-host 4 --project-tp 1,2 --model tiny \
    >"$work/projected" 2>&1 || { cat "$work/projected"; fail "--project-tp failed"; }
  for want in "     8  FSDP 4 x TP 2" "     8  HSDP 2x2 x TP 2"; do
    grep -qF -- "$want" "$work/projected" || { cat "$work/projected"; fail "no '$want' in the projection"; }
  done
  "$train" --project "$work/cost.json" --project-worlds 8 --gpus-per-host 4 --project-tp 1,2 --model tiny \
    --memory-budget 1 >"$work/projected" 2>&1 || { cat "$work/projected"; fail "--project --memory-budget failed"; }
  for want in "8 GPUs, a budget of 1.00 GiB each:" "<- chosen" "chosen schedule: recompute"; do
    grep -qF -- "$want" "$work/projected" || { cat "$work/projected"; fail "no '$want' in the layout plan"; }
  done
  [ "$(grep -c " ms  peak " "$work/projected")" = 4 ] || { cat "$work/projected"; fail "not four layouts planned"; }
  for bad in "--project-tp 2 --model small:is not a profile of the small model" "--project-tp 3:must divide by it"; do
    "$train" --project "$work/cost.json" ${bad%%:*} >"$work/projected" 2>&1 &&
      fail "--project-tp with ${bad%%:*} was not refused"
    grep -qF -- "${bad#*:}" "$work/projected" || { cat "$work/projected"; fail "no '${bad#*:}'"; }
  done
  "$train" --project "$work/out" >"$work/projected" 2>&1 && fail "--project read a file that is no cost model"
  grep -qF "is not a cost model" "$work/projected" || { cat "$work/projected"; fail "no refusal of a bad cost model"; }
  # Gradient accumulation (a reduce-scatter every micro-batch): planned for two passes a step.
  "$run" "${common[@]}" --steps 7 --memory-budget 1 --grad-accum 2 --grad-accum-sync every \
    --log "$work/accum.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "the planned run with --grad-accum failed"; }
  grep -qF "fsdp-train:   predicted" "$work/out" || { cat "$work/out"; fail "no plan with --grad-accum"; }
  "$run" "${common[@]}" --steps 7 --memory-budget 1 --grad-accum 2 --log "$work/accum-last.jsonl" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "the planned run with --grad-accum (sync last) failed"; }
  grep -qF "fsdp-train:   predicted" "$work/out" || { cat "$work/out"; fail "no plan with --grad-accum-sync last"; }
  "$run" "${common[@]}" --steps 6 --memory-budget 0.0001 >"$work/out" 2>&1
  code=$?
  [ "$code" = 2 ] || { cat "$work/out"; fail "exit code $code, not 2, for a budget too small"; }
  grep -q "is too small: .* the smallest budget that fits is" "$work/out" || { cat "$work/out"; fail "no refusal"; }
  echo "planned and trained; the cost model projected; too small a budget refused: ok"
  ;;
diverge)
  if [ "${3:-cpu}" = gpu ]; then launch=(--gpu -n 1); else launch=(-n 2 --cpu); fi
  common=("${launch[@]}" "$train" --model tiny --seq 32 --steps 8 --lr 1e8 --min-lr 0 --warmup 0 --save-every 1)
  "$run" "${common[@]}" --save-dir "$work/ck" --export "$work/model" --log "$work/log.jsonl" >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 1 ] || fail "exit code $code, not 1, for a run that diverged"
  diverged='training diverged; nothing saved or exported after it'
  bad=$(sed -n "s/^fsdp-train: error: step \([0-9]*\): the loss is .*: $diverged.*/\1/p" "$work/out")
  [ -n "$bad" ] || fail "no divergence error naming the step"
  ! grep -q "fsdp-train: done" "$work/out" || fail "claims to be done"
  [ ! -e "$work/model" ] || fail "exported a diverged model"
  last=$(printf 'step-%06d' $((bad - 1)))
  [ "$(ls "$work/ck" | tail -1)" = "$last" ] || fail "saved past step $bad: $(ls "$work/ck")"
  grep -q "\"step\":$bad,.*null" "$work/log.jsonl" || fail "the log does not record the non-finite value as null"
  # Skipping: a skipped step takes no optimizer step, so the state saved after it is the state
  # saved before it, bit for bit; past the allowance the run stops as above.
  "$run" "${common[@]}" --save-dir "$work/skip" --max-skipped-steps 2 --log "$work/skip.jsonl" >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 1 ] || fail "exit code $code, not 1, past --max-skipped-steps"
  for n in 1 2; do
    step=$((bad + n - 1))
    grep -q "fsdp-train: step $step: the loss is .*: skipped, no optimizer step ($n of --max-skipped-steps 2)" \
      "$work/out" || fail "step $step not reported skipped"
    for f in "$work/skip/$last"/shard-*; do
      cmp "$f" "$work/skip/$(printf 'step-%06d' $step)/$(basename "$f")" || fail "skipped step $step changed $f"
    done
  done
  grep -q "error: step $((bad + 2)): .*(past --max-skipped-steps 2): training diverged" "$work/out" ||
    fail "no stop after 2 skips"
  [ "$(grep -c '"skipped":true' "$work/skip.jsonl")" = 3 ] || fail "the log does not mark the skipped steps"
  echo "diverge: ok (first non-finite step $bad)"
  ;;
runs)
  common=(-n 2 --cpu "$train" --model tiny --seq 32)
  "$run" "${common[@]}" --steps 6 --save-dir "$work/ck" --log "$work/a.jsonl" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "the first run"; }
  # Another fresh run into the same directory: refused, naming the fixes.
  expect_usage_error "--save-dir: '$work/ck' holds checkpoints of another run (newest '$work/ck/step-000006', run" \
    "${common[@]}" --steps 4 --save-dir "$work/ck"
  # --overwrite: the old run's checkpoints go, so a later --resume takes this run's.
  "$run" "${common[@]}" --steps 4 --save-dir "$work/ck" --overwrite --log "$work/b.jsonl" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "--overwrite"; }
  [ "$(ls "$work/ck")" = step-000004 ] || fail "--overwrite left: $(ls "$work/ck")"
  # The same command again: its first save replaces the other run's step-4 (as it was told).
  "$run" "${common[@]}" --steps 4 --save-dir "$work/ck" --overwrite-checkpoints --log "$work/b2.jsonl" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "--overwrite-checkpoints over a checkpoint of the same step"; }
  [ "$(ls "$work/ck")" = step-000004 ] || fail "--overwrite-checkpoints left: $(ls "$work/ck")"
  # The same run continued in its own directory: allowed; the checkpoint itself names the run.
  "$run" "${common[@]}" --steps 6 --resume "$work/ck/step-000004" --save-dir "$work/ck" --log "$work/c.jsonl" \
    >"$work/out" 2>&1 || { cat "$work/out"; fail "resume from the checkpoint itself"; }
  grep -q "resumed from $work/ck/step-000004 (step 4, run [0-9a-f]*)" "$work/out" || fail "no resume line"
  [ "$(ls "$work/ck" | tr '\n' ' ')" = "step-000004 step-000006 " ] || fail "resumed run saved: $(ls "$work/ck")"
  # Nothing left to train: refused, unless the resume is to export.
  expect_usage_error "--resume: '$work/ck/step-000006' is at step 6 and --steps is 6: nothing to train" \
    "${common[@]}" --steps 6 --resume "$work/ck"
  "$run" "${common[@]}" --steps 6 --resume "$work/ck" --export "$work/model.safetensors" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "resume to export"; }
  grep -q "nothing to train" "$work/out" && [ -s "$work/model.safetensors" ] || { cat "$work/out"; fail "no export"; }
  expect_usage_error "--export: '$work/model.safetensors' already exists: pass --overwrite-export" \
    "${common[@]}" --steps 6 --resume "$work/ck" --export "$work/model.safetensors"
  echo "runs: ok"
  ;;
rank-failures)
  "$run" -n 2 --cpu /nonexistent/program >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 127 ] || fail "exit code $code, not 127, for a program that does not exist"
  [ "$(cat "$work/out")" = "fsdp-run: cannot run /nonexistent/program: no such executable file" ] || fail "message"
  "$run" -n 2 --cpu no-such-program-on-path >"$work/out" 2>&1
  [ $? = 127 ] && grep -q "not found on PATH" "$work/out" || fail "a name not on PATH"
  # Rank 1 dies of SIGKILL (as the kernel's OOM killer does); rank 0 would wait for it.
  "$run" -n 2 --cpu sh -c 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then kill -9 $$; fi; sleep 30' >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 137 ] || fail "exit code $code, not 137, for a rank killed by SIGKILL"
  [ "$(grep -c . "$work/out")" = 1 ] || fail "not one line"
  grep -q "^fsdp-run: rank 1 (pid [0-9]*) was killed by signal 9 (Killed)$" "$work/out" ||
    fail "no line naming the rank"
  "$run" -n 2 --cpu sh -c 'kill -SEGV $$' >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 139 ] && grep -q "was killed by signal 11 (Segmentation fault)" "$work/out" || fail "SIGSEGV ($code)"
  # A rank that exits non-zero without a word: fsdp-run names it (2 and 3 are fsdp-train's own,
  # which it reports itself).
  "$run" -n 2 --cpu sh -c 'exit 4' >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 4 ] && grep -q "^fsdp-run: rank [01] (pid [0-9]*) exited with status 4$" "$work/out" || fail "exit 4 ($code)"
  # mpirun itself killed (kill -9): fsdp-run names it and stops the ranks it leaves behind.
  marker="$work/mpirun-killed"
  "$run" -n 2 --cpu sh -c "sleep 60 # $marker" >"$work/out" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [ "$(pgrep -f -- "sleep 60 # $marker" | wc -l)" -ge 4 ] && break; sleep 0.1; done
  mpirun=$(pgrep -P "$pid" mpirun)
  [ -n "$mpirun" ] || fail "mpirun not found under fsdp-run"
  kill -9 "$mpirun"
  wait "$pid"
  code=$?
  cat "$work/out"
  [ "$code" = 137 ] && grep -q "^fsdp-run: mpirun (pid $mpirun) was killed by signal 9 (Killed); stopping the ranks it left$" \
    "$work/out" || fail "mpirun killed: exit $code, not named"
  sleep 0.5
  [ "$(pgrep -f -- "sleep 60 # $marker" | wc -l)" = 0 ] || fail "ranks left running: $(pgrep -af -- "$marker")"
  # SIGTERM while the ranks start: they stop as asked (at the first step boundary, or before they
  # handle signals), never reported as killed by fsdp-run's SIGUSR1.
  "$run" -n 2 --cpu "$train" --model tiny --steps 100000 --seq 32 --log "$work/early.jsonl" >"$work/out" 2>&1 &
  pid=$!
  sleep 0.5
  kill -TERM "$pid"
  wait "$pid"
  code=$?
  cat "$work/out"
  [ "$code" = 143 ] || fail "exit code $code, not 143, for SIGTERM during start-up"
  ! grep -q "signal 10\|User defined signal" "$work/out" || fail "the stop request reported as a kill"
  echo "rank failures: ok"
  ;;
lineage)
  common=(-n 2 --cpu "$train" --model tiny --seq 32)
  "$run" "${common[@]}" --steps 20 --save-every 10 --save-dir "$work/ck" --log "$work/a.jsonl" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "the first run"; }
  # 1. --overwrite on a resumed run that then diverges: its own checkpoints stay.
  "$run" "${common[@]}" --steps 40 --resume "$work/ck" --save-dir "$work/ck" --overwrite --export "$work/x" \
    --lr 1e8 --log "$work/b.jsonl" >"$work/out" 2>&1
  [ $? = 1 ] || { cat "$work/out"; fail "the diverging resume did not fail"; }
  [ "$(ls "$work/ck" | tr '\n' ' ')" = "step-000010 step-000020 " ] || fail "--overwrite removed the run's own: $(ls "$work/ck")"
  # 4. A resume from step 10 saves 11 and 12: step 20, the abandoned branch, goes aside.
  "$run" "${common[@]}" --steps 40 --stop-at-step 12 --save-every 1 --resume "$work/ck/step-000010" \
    --save-dir "$work/ck" --log "$work/c.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "resume from step 10"; }
  grep -q "holds this run's checkpoints after step 10, a branch this resume leaves: moved to $work/ck/abandoned-after-step-000010-" \
    "$work/out" || { cat "$work/out"; fail "the abandoned branch is not reported"; }
  ls "$work"/ck/abandoned-after-step-000010-*/step-000020/metadata.bin >/dev/null || fail "step 20 is not kept aside"
  "$run" "${common[@]}" --steps 40 --resume "$work/ck" --save-dir "$work/ck" --dry-run >"$work/out" 2>&1
  grep -q "resumes $work/ck/step-000012" "$work/out" || { cat "$work/out"; fail "--resume does not take the new branch"; }
  # 7, 6. --stop-at-step before the checkpoint; other data or seed than it trained on.
  expect_usage_error "--stop-at-step 5 is not after the checkpoint's step 12" "${common[@]}" --steps 40 --resume "$work/ck" --stop-at-step 5 --save-dir "$work/ck"
  printf '%0600d' 0 >"$work/text.txt"
  expect_usage_error "was trained on --data synthetic, this run has --data $work/text.txt" \
    "${common[@]}" --steps 40 --resume "$work/ck" --data "$work/text.txt"
  expect_usage_error "was trained with --seed 1234, this run has --seed 7: pass --seed 1234, or --allow-resume-changes" \
    "${common[@]}" --steps 40 --resume "$work/ck" --seed 7
  "$run" "${common[@]}" --steps 40 --resume "$work/ck" --seed 7 --allow-resume-changes --dry-run >/dev/null 2>&1 ||
    fail "--allow-resume-changes refused"
  # 2. An export that would replace the save directory or the log's.
  expect_usage_error "--export '$work/ck' would replace --save-dir '$work/ck'" \
    "${common[@]}" --steps 40 --save-dir "$work/ck" --export "$work/ck" --overwrite
  mkdir -p "$work/logs" && touch "$work/logs/x"
  expect_usage_error "--export '$work/logs' would replace --log '$work/logs/run.jsonl'" \
    "${common[@]}" --steps 4 --log "$work/logs/run.jsonl" --export "$work/logs" --overwrite
  # A damaged newest checkpoint: the error names the next older one.
  for f in "$work"/ck/step-000012/shard-*; do printf 'xx' | dd of="$f" bs=1 seek=8 conv=notrunc 2>/dev/null; done
  "$run" "${common[@]}" --steps 40 --resume "$work/ck" --log "$work/d.jsonl" >"$work/out" 2>&1
  [ $? = 1 ] || { cat "$work/out"; fail "a damaged checkpoint resumed"; }
  grep -q "checksum mismatch.*the next older checkpoint is '$work/ck/step-000011': --resume $work/ck/step-000011" \
    "$work/out" || { cat "$work/out"; fail "the next older checkpoint is not named"; }
  # --keep-last 2: the newest two of the run's lineage stay, across a resume.
  "$run" "${common[@]}" --steps 10 --save-every 2 --keep-last 2 --save-dir "$work/keep" --log "$work/k1.jsonl" \
    >"$work/out" 2>&1 || { cat "$work/out"; fail "--keep-last"; }
  [ "$(ls "$work/keep" | tr '\n' ' ')" = "step-000008 step-000010 " ] || fail "--keep-last 2 left: $(ls "$work/keep")"
  "$run" "${common[@]}" --steps 14 --save-every 2 --keep-last 2 --resume "$work/keep" --save-dir "$work/keep" \
    --log "$work/k2.jsonl" >"$work/out" 2>&1 || { cat "$work/out"; fail "--keep-last after a resume"; }
  [ "$(ls "$work/keep" | tr '\n' ' ')" = "step-000012 step-000014 " ] || fail "--keep-last 2 after a resume left: $(ls "$work/keep")"
  expect_usage_error "--keep-last needs --save-dir" "${common[@]}" --steps 4 --keep-last 2
  echo "lineage: ok"
  ;;
concurrent)
  common=(-n 2 --cpu "$train" --model tiny --seq 32)
  "$run" "${common[@]}" --steps 100000 --save-dir "$work/ck" --log "$work/first.jsonl" >"$work/first.out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q "step    2/" "$work/first.out" && break; sleep 0.1; done
  grep -q "step    2/" "$work/first.out" || { cat "$work/first.out"; fail "the first run never started"; }
  "$run" "${common[@]}" --steps 4 --save-dir "$work/ck" --log "$work/second.jsonl" >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 2 ] && grep -q "fsdp-train: error: --save-dir: '$work/ck' is in use by another run (run [0-9a-f]*, pid [0-9]* on " \
    "$work/out" || fail "a second run on the save directory in use (exit $code)"
  "$run" "${common[@]}" --steps 4 --log "$work/first.jsonl" >"$work/out" 2>&1
  code=$?
  cat "$work/out"
  [ "$code" = 2 ] && grep -q "'$work/first.jsonl' is being written by another run" "$work/out" ||
    fail "a second run on the log in use (exit $code)"
  kill -TERM "$pid"
  wait "$pid"
  [ $? = 3 ] || { cat "$work/first.out"; fail "the first run did not stop as a resumable run (exit 3)"; }
  python3 - "$work/first.jsonl" <<'PY' || fail "the first run's log is damaged"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), rows
PY
  echo "concurrent: ok"
  ;;
keeps-files)
  common=(-n 2 --cpu "$train" --model tiny --seq 32)
  lines() { grep -c . "$1"; }
  log="$work/run.jsonl"
  "$run" "${common[@]}" --steps 4 --save-dir "$work/ck" --log "$log" >"$work/out" 2>&1 || { cat "$work/out"; fail "the first run"; }
  [ "$(lines "$log")" = 4 ] || fail "the first run logged $(lines "$log") lines"
  # Another run on the log, the flags read back from beside it, a fresh start after a kill: refused.
  expect_usage_error "--log: '$log' already holds steps 1-4 of run " "${common[@]}" --steps 4 --log "$log"
  expect_usage_error "a log is never emptied" --cpu -n 2 "$train" --config "${log%.jsonl}.config.json" \
    --save-dir "$work/elsewhere"
  [ "$(lines "$log")" = 4 ] || fail "a refused run changed the log"
  # The run resumed: appended after its checkpoint's step, the first new line marked.
  "$run" "${common[@]}" --steps 8 --resume "$work/ck" --save-dir "$work/ck" --log "$log" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "the resumed run"; }
  python3 - "$log" <<'PY' || fail "the resumed run's log"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["step"] for r in rows] == list(range(1, 9)), rows
assert "run" in rows[0] and rows[4]["run"] == rows[0]["run"] and rows[4]["resumed_from"] == 4, rows[4]
PY
  # A resume that fails at load (another model) leaves the log as it was.
  "$run" -n 2 --cpu "$train" --model small --seq 32 --steps 12 --resume "$work/ck" --save-dir "$work/ck" \
    --log "$log" --allow-resume-changes >"$work/out" 2>&1 && fail "a resume of another model's checkpoint ran"
  [ "$(lines "$log")" = 8 ] || { cat "$work/out"; fail "a failed resume left $(lines "$log") lines of 8"; }
  # SIGTERM with --export: saved, nothing exported, exit 3; the requeued command finishes and exports.
  requeue=(--save-dir "$work/q" --export "$work/model" --log "$work/q.jsonl")
  "$run" "${common[@]}" --steps 100000 "${requeue[@]}" >"$work/out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q "step    3/" "$work/out" && break; sleep 0.1; done
  kill -TERM "$pid"
  wait "$pid"
  code=$?
  [ "$code" = 3 ] || { cat "$work/out"; fail "a stopped run exited $code, not 3"; }
  grep -q "not exported: the run stopped at step [0-9]* of 100000" "$work/out" || { cat "$work/out"; fail "no word of the export"; }
  [ ! -e "$work/model" ] || fail "a stopped run published its export"
  # Requeued with --resume (and, to end soon, a --steps just past the stop).
  steps=$(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['step'] + 2)" "$work/q.jsonl")
  "$run" "${common[@]}" --steps "$steps" "${requeue[@]}" --resume "$work/q" >"$work/out" 2>&1 ||
    { cat "$work/out"; fail "the requeued run"; }
  grep -q "exported $work/model" "$work/out" && [ -f "$work/model/config.json" ] || { cat "$work/out"; fail "no export"; }
  # An export that appears while the run trains (another run's) is never replaced.
  "$run" "${common[@]}" --steps 400 --export "$work/theirs" --log "$work/race.jsonl" >"$work/out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q "step    2/" "$work/out" && break; sleep 0.1; done
  mkdir "$work/theirs" && echo "another run's" >"$work/theirs/config.json"
  wait "$pid"
  code=$?
  [ "$code" = 1 ] && grep -q "'$work/theirs' appeared while this run exported" "$work/out" ||
    { cat "$work/out"; fail "an export over one that appeared meanwhile (exit $code)"; }
  [ "$(cat "$work/theirs/config.json")" = "another run's" ] || fail "the other run's export was replaced"
  ls -d "$work"/theirs.tmp-* >/dev/null || fail "this run's model is not left beside it"
  echo "keeps files: ok"
  ;;
*) fail "unknown mode $mode" ;;
esac
