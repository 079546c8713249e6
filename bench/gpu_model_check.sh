#!/usr/bin/env bash
# The model's kernels against what PyTorch users run (issue #12) on 2 GPUs, one part per device call
# (each at most 9 minutes; back to back, the machine stays warm and the build is reused):
#   suite   build, the 2-rank GPU suite (kernels against ATen, parity) and 2-GPU training runs, the
#           SDPA backends at the benchmark's shapes, an allocator snapshot of 1b-ac (where its
#           reserved-but-free memory sits at the peak: bench/snapshot_holes.py)
#   1b      run_bench.py 1b: fsdp.cpp vs FSDP2 eager and compiled, REPEATS times
#   1b-ac   the same with activation checkpointing, then 1b-lowlr once (the loss agreement at lr 1e-4)
#   small   small vs FSDP2 eager, compiled and DDP, and small-flash (fsdp.cpp with FlashAttention-2
#           instead of ATen's choice), REPEATS times
#   8b-ac   8b with checkpointing vs eager FSDP2 (each its own initial weights), REPEATS times
# and the memory-budget planner (issue #13):
#   plan-1b build, fsdp-train --plan-check on the 1B (predicted vs measured for no and full
#           checkpointing and 8 budgets' plans), the same checkpointed blocks in eager FSDP2, the
#           frontier (bench/plan_frontier.py)
#   plan-check-1b  the GPU suite and training runs, --plan-check on the 1B (10 steps a schedule) and
#           its frontier, without FSDP2; then the same with 2 micro-batches of batch 2 a step
#           (reduce-scattered each, or only the last with ACCUM_SYNC=last)
#   plan-1gpu  on ONE GPU: the 1-rank suite and training runs, --plan-check on the 1B (batch 4) and with
#           2 micro-batches of batch 2 reduce-scattered only at the last, each with its frontier; with
#           BASE=<a git archive tar of another commit, in the tree>, that commit built beside it
#           (/tmp/fsdp-base) and its plan checks run the same way (files *-base.*): predictions A/B
#   plan-small  the GPU suite and training runs, --plan-check on the small model (24 blocks of 6 MB:
#           collective latency matters), with the bucketed fixed points; 2 GPUs, or 1 if only one
#   overlap-1b  the contention the planner calibrates (bench/trace_overlap.py: one step of the 1B
#           with every block checkpointed, traced at prefetch depth 0 and at 1)
#   plan-8b the 2-rank GPU suite and 2-GPU training runs, --plan-check on the 8B, and
#           --memory-budget 48 --plan-only on the 8B
# and CPU offload (issue #14):
#   offload the 2-rank GPU suite and training runs (offloaded too), a checkpoint saved offloaded and
#           resumed on the device, the 1B offloaded
#   offload-8b  the 8B offloaded, and under FSDP2's CPUOffloadPolicy
#   offload-budget  the 8B offloaded: --memory-budget 48 (plans and trains), and every block checkpointed
#   offload-1gpu  on ONE GPU: the 1-rank suite and training runs (offloaded, optimizer in backward), the
#           8B offloaded with the optimizer in backward
#   device-1gpu  on ONE GPU: the 8B offloaded with the optimizer after backward, and not offloaded
#           (every block checkpointed at batch 1; none at batch 2)
#   host-steps-1gpu  on ONE GPU: the 1-rank suite and training runs, the 8B offloaded with the
#           optimizer in backward on backward's thread (--max-pending-host-steps 0) and on the host
#           worker (2, the default; one step traced)
#   offload-h100  on ONE H100 (80 GB, where the 8B's sharded state cannot fit): the 1-rank suite
#           and training runs, the 8B offloaded with the optimizer in backward, and not offloaded
#           (the trainer's refusal)
#   guarded-8b-1gpu  on ONE GPU, each under bench/host_memory_guard.py (killed before the host runs out
#           of memory): FSDP2's CPUOffloadPolicy on the 8B, and fsdp.cpp's 8B offloaded with the
#           optimizer in backward
#   offload-1b-1gpu  on ONE GPU: the 1-rank suite and training runs, the 1B offloaded (optimizer after
#           backward; in backward on backward's thread and on the host worker), and under FSDP2's
#           CPUOffloadPolicy
# and HSDP (issue #14):
#   hsdp    the 2-rank GPU suite and training runs (HSDP too), a checkpoint saved under HSDP resumed
#           under plain FSDP, the 1B as 1 x 2 (plain FSDP) and as 2 x 1 (two replicas), one step traced
#   two-nodes   the README's torchrun line on one node, and the trainer launched as on 2 machines
#           of one GPU each (bench/two_nodes_on_one_host.sh): torchrun's rendezvous, LOCAL_RANK, the
#           NCCL id across "nodes"; plain FSDP and HSDP (a replica a node)
# and the package (issue #15):
#   package the GPU suite and training runs, the installed package's examples (mlp, gpt2, built
#           against cmake --install, on the GPUs), the subproject configure check, the 1B for 10 steps
# Every phase has its own time limit, so a slow one cannot take the others' results with it;
# everything lands in one tar per part under OUT, packed again after every phase.
#   bash bench/gpu_model_check.sh OUT COMMIT PART [STEPS] [REPEATS]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}; commit=${2:-unknown}
part=${3:?part: suite, 1b, 1b-ac, small, 8b-ac, plan-1b, plan-check-1b, plan-1gpu, plan-small, plan-8b, overlap-1b,
  offload, offload-8b, offload-budget, offload-1gpu, device-1gpu, host-steps-1gpu, offload-1b-1gpu, offload-h100,
  guarded-8b-1gpu, hsdp, two-nodes, package}
steps=${4:-10}; repeats=${5:-3}
source bench/gpu_env.sh
work=/tmp/fsdp-check-$part
rm -rf "$work" && mkdir -p "$work" "$out"
pack() {
  gzip -f "$work"/*/profile-*-rank0.json 2>/dev/null
  rm -f "$out/$part.tgz.part"*
  tar czf - -C /tmp --exclude='init-*.pt' --exclude='profile-*-rank[1-9]*' --exclude='*.pickle' \
    "fsdp-check-$part" | split -b 15M -d - "$out/$part.tgz.part"
}
record_env "$work/env.txt" "$commit"
phase() {  # phase NAME SECONDS COMMAND...: runs COMMAND under a time limit into NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" > "$work/$name.log" 2>&1
  local status=$?
  pkill -f build/fsdp-train; pkill -f bench/fsdp2_llama.py  # what a cut-off phase left running
  echo "$name: exit $status after $((SECONDS - start)) s" | tee -a "$work/phases.txt"
  tail -4 "$work/$name.log"
  pack
  return $status
}
bench() {  # bench NAME SECONDS RUN_BENCH_ARGS...
  local name=$1 limit=$2; shift 2
  phase "$name" "$limit" python3 bench/run_bench.py --out "$work/$name" --commit "$commit" --steps "$steps" "$@"
}
phase build 240 env FSDP_JOBS="$(nproc)" bash scripts/setup.sh || exit 1
case $part in
  suite)
    phase gpu-tests 120 ctest --test-dir build -R '^(gpu_2_ranks|train_gpu_2|train_gpu_2_recompute)$' \
      --output-on-failure
    phase sdpa 30 python3 bench/sdpa_backends.py
    phase snapshot-1b-ac 90 build/fsdp-run --gpu -n 2 build/fsdp-train --model 1b --seq 2048 --batch 4 \
      --recompute --steps 5 --param-dtype bf16 --log "$work/snapshot-1b-ac.jsonl" \
      --memory-snapshot "$work/snapshot-1b-ac"
    phase holes-1b-ac 60 python3 bench/snapshot_holes.py "$work/snapshot-1b-ac-rank0.pickle" --step 4 ;;
  1b) bench bench-1b 560 --configs 1b --repeats "$repeats" ;;
  1b-ac)
    bench bench-1b-ac 450 --configs 1b-ac --repeats "$repeats"
    bench bench-1b-lowlr 100 --configs 1b-lowlr ;;
  small) bench bench-small 520 --configs small,small-flash --repeats "$repeats" ;;
  8b-ac) bench bench-8b-ac 520 --configs 8b-ac --repeats "$repeats" ;;
  plan-1b)
    phase plan-check-1b 200 build/fsdp-run --gpu -n 2 build/fsdp-train --model 1b --seq 2048 --batch 4 \
      --param-dtype bf16 --steps 5 --plan-check "$work/plan-check-1b.jsonl" --log "$work/plan-1b.jsonl"
    phase frontier-1b 330 python3 bench/plan_frontier.py --check "$work/plan-check-1b.jsonl" \
      --out "$work/frontier-1b" --fsdp2 "--model 1b --seq 2048 --batch 4 --steps 6" ;;
  plan-check-1b)
    phase gpu-tests 300 ctest --test-dir build --output-on-failure -R '^(unit|gpu_2_ranks|train_gpu_2|'\
'train_gpu_2_recompute|train_gpu_2_offload|train_gpu_2_hsdp)$'
    phase plan-check-1b 200 build/fsdp-run --gpu -n 2 build/fsdp-train --model 1b --seq 2048 --batch 4 \
      --param-dtype bf16 --steps 5 --plan-check "$work/plan-check-1b.jsonl" --plan-check-steps 10 \
      --log "$work/plan-1b.jsonl"
    phase frontier-1b 30 python3 bench/plan_frontier.py --check "$work/plan-check-1b.jsonl" --out "$work/frontier-1b"
    phase plan-check-1b-accum 200 build/fsdp-run --gpu -n 2 build/fsdp-train --model 1b --seq 2048 --batch 2 \
      --grad-accum 2 --grad-accum-sync "${ACCUM_SYNC:-every}" --param-dtype bf16 --steps 5 \
      --plan-check "$work/plan-check-1b-accum.jsonl" --log "$work/plan-1b-accum.jsonl"
    phase frontier-1b-accum 30 python3 bench/plan_frontier.py --check "$work/plan-check-1b-accum.jsonl" \
      --out "$work/frontier-1b-accum" ;;
  plan-1gpu)
    phase gpu-tests 300 ctest --test-dir build --output-on-failure -R '^(unit|gpu_1_ranks|train_gpu_1|'\
'train_gpu_1_recompute|train_gpu_1_offload|train_gpu_1_optimizer_in_backward)$'
    plan_checks() {  # plan_checks TREE SUFFIX: the two plan checks with TREE's binaries
      local tree=$1 suffix=$2
      phase plan-check-1b$suffix 200 "$tree"/build/fsdp-run --gpu -n 1 "$tree"/build/fsdp-train --model 1b \
        --seq 2048 --batch 4 --param-dtype bf16 --steps 5 --plan-check "$work/plan-check-1b$suffix.jsonl" \
        --plan-check-steps 10 --log "$work/plan-1b$suffix.jsonl"
      phase frontier-1b$suffix 30 python3 bench/plan_frontier.py --check "$work/plan-check-1b$suffix.jsonl" \
        --out "$work/frontier-1b$suffix"
      phase plan-check-1b-accum$suffix 200 "$tree"/build/fsdp-run --gpu -n 1 "$tree"/build/fsdp-train \
        --model 1b --seq 2048 --batch 2 --grad-accum 2 --grad-accum-sync last --param-dtype bf16 --steps 5 \
        --plan-check "$work/plan-check-1b-accum$suffix.jsonl" --log "$work/plan-1b-accum$suffix.jsonl"
      phase frontier-1b-accum$suffix 30 python3 bench/plan_frontier.py \
        --check "$work/plan-check-1b-accum$suffix.jsonl" --out "$work/frontier-1b-accum$suffix"
    }
    plan_checks . ""
    if [ -n "${BASE:-}" ]; then
      rm -rf /tmp/fsdp-base && mkdir -p /tmp/fsdp-base && tar xf "$BASE" -C /tmp/fsdp-base
      [ -d .whl ] && cp -r .whl /tmp/fsdp-base/
      phase build-base 300 env FSDP_JOBS="$(nproc)" bash /tmp/fsdp-base/scripts/setup.sh &&
        plan_checks /tmp/fsdp-base -base
    fi ;;
  plan-small)  # on 2 GPUs, or on 1 where only one is lent
    gpus=$(( $(nvidia-smi -L | wc -l) > 1 ? 2 : 1 ))
    phase gpu-tests 200 ctest --test-dir build --output-on-failure -R "^(unit|gpu_${gpus}_ranks|train_gpu_${gpus}|"\
"train_gpu_${gpus}_recompute|train_gpu_${gpus}_optimizer_in_backward)\$"
    phase plan-check-small 200 build/fsdp-run --gpu -n $gpus build/fsdp-train --model small --seq 1024 --batch 4 \
      --param-dtype bf16 --steps 5 --plan-check "$work/plan-check-small.jsonl" --plan-check-steps 10 \
      --log "$work/plan-small.jsonl"
    phase frontier-small 30 python3 bench/plan_frontier.py --check "$work/plan-check-small.jsonl" \
      --out "$work/frontier-small" ;;
  overlap-1b)
    for depth in 0 1; do  # the contention the calibration prices: step 2 traced at prefetch depth 0 and 1
      phase overlap-1b-depth$depth 60 build/fsdp-run --gpu -n 2 build/fsdp-train --model 1b --seq 2048 --batch 4 \
        --param-dtype bf16 --recompute --prefetch-depth $depth --steps 3 --trace "$work/overlap-depth$depth" \
        --trace-steps 1 --log "$work/overlap-depth$depth.jsonl"
    done
    phase overlap-1b 20 python3 bench/trace_overlap.py "$work"/overlap-depth{0,1}-rank{0,1}.json \
      --json "$work/overlap-1b.json" ;;
  plan-8b)
    phase gpu-tests 150 ctest --test-dir build -R '^(gpu_2_ranks|train_gpu_2|train_gpu_2_recompute)$' \
      --output-on-failure
    phase plan-check-8b 240 build/fsdp-run --gpu -n 2 build/fsdp-train --model 8b --seq 2048 --batch 2 \
      --param-dtype bf16 --steps 5 --plan-check "$work/plan-check-8b.jsonl" --plan-check-budgets 6 \
      --plan-check-steps 4 --log "$work/plan-8b.jsonl"
    phase frontier-8b 20 python3 bench/plan_frontier.py --check "$work/plan-check-8b.jsonl" --out "$work/frontier-8b"
    phase budget-48-8b 150 build/fsdp-run --gpu -n 2 build/fsdp-train --model 8b --seq 2048 --batch 2 \
      --param-dtype bf16 --steps 5 --memory-budget 48 --plan-only --log "$work/budget-48-8b.jsonl" ;;
  offload)
    phase gpu-tests 200 ctest --test-dir build --output-on-failure \
      -R '^(gpu_2_ranks|train_gpu_2|train_gpu_2_recompute|train_gpu_2_offload|train_gpu_2_optimizer_in_backward)$'
    phase offload-resume 120 bash -c "build/fsdp-run --gpu -n 2 build/fsdp-train --model tiny --seq 64 --steps 10 \
      --cpu-offload --save-dir $work/ckpt --log $work/offload-save.jsonl && build/fsdp-run --gpu -n 2 \
      build/fsdp-train --model tiny --seq 64 --steps 20 --resume $work/ckpt --log $work/device-resume.jsonl"
    phase offload-1b 120 build/fsdp-run --gpu -n 2 build/fsdp-train --model 1b --seq 2048 --batch 4 \
      --param-dtype bf16 --cpu-offload --steps 6 --log "$work/offload-1b.jsonl" ;;
  offload-8b)
    phase offload-8b 200 build/fsdp-run --gpu -n 2 build/fsdp-train --model 8b --seq 2048 --batch 2 \
      --param-dtype bf16 --cpu-offload --steps 5 --log "$work/offload-8b.jsonl"
    phase fsdp2-offload-8b 200 python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
      bench/fsdp2_llama.py --model 8b --seq 2048 --batch 2 --steps 5 --cpu-offload \
      --jsonl "$work/fsdp2-offload-8b.jsonl" ;;
  offload-budget)
    phase budget-48-8b 330 build/fsdp-run --gpu -n 2 build/fsdp-train --model 8b --seq 2048 --batch 2 \
      --param-dtype bf16 --cpu-offload --memory-budget 48 --steps 7 --log "$work/budget-48-8b.jsonl"
    phase offload-8b-ac 200 build/fsdp-run --gpu -n 2 build/fsdp-train --model 8b --seq 2048 --batch 2 \
      --param-dtype bf16 --cpu-offload --recompute --steps 5 --log "$work/offload-8b-ac.jsonl" ;;
  offload-1gpu)
    phase gpu-tests 240 ctest --test-dir build --output-on-failure \
      -R '^(unit|gpu_1_ranks|train_gpu_1|train_gpu_1_recompute|train_gpu_1_offload|train_gpu_1_optimizer_in_backward)$'
    phase offload-8b-1gpu 330 build/fsdp-run --gpu -n 1 build/fsdp-train --model 8b --seq 2048 --batch 2 \
      --param-dtype bf16 --cpu-offload --optimizer-in-backward --clip 0 --steps 5 --log "$work/offload-8b-1gpu.jsonl" ;;
  device-1gpu)
    phase offload-8b-1gpu-after-backward 240 build/fsdp-run --gpu -n 1 build/fsdp-train --model 8b --seq 2048 \
      --batch 2 --param-dtype bf16 --cpu-offload --clip 0 --steps 5 --log "$work/refused.jsonl"
    phase device-8b-1gpu 150 build/fsdp-run --gpu -n 1 build/fsdp-train --model 8b --seq 2048 --batch 1 \
      --param-dtype bf16 --recompute --steps 3 --log "$work/device-8b-1gpu.jsonl"
    phase device-8b-1gpu-batch2 150 build/fsdp-run --gpu -n 1 build/fsdp-train --model 8b --seq 2048 --batch 2 \
      --param-dtype bf16 --steps 3 --log "$work/device-8b-1gpu-batch2.jsonl" ;;
  host-steps-1gpu)
    phase gpu-tests 240 ctest --test-dir build --output-on-failure \
      -R '^(unit|gpu_1_ranks|train_gpu_1|train_gpu_1_recompute|train_gpu_1_offload|train_gpu_1_optimizer_in_backward)$'
    for pending in 0 2; do
      phase offload-8b-1gpu-pending$pending 150 build/fsdp-run --gpu -n 1 build/fsdp-train --model 8b --seq 2048 \
        --batch 2 --param-dtype bf16 --cpu-offload --optimizer-in-backward --clip 0 --steps 6 \
        --max-pending-host-steps $pending --trace "$work/trace-8b-pending$pending" --trace-steps 1 \
        --log "$work/offload-8b-1gpu-pending$pending.jsonl"
    done ;;
  offload-h100)
    phase gpu-tests 240 ctest --test-dir build --output-on-failure \
      -R '^(unit|gpu_1_ranks|train_gpu_1|train_gpu_1_recompute|train_gpu_1_offload|train_gpu_1_optimizer_in_backward)$'
    phase offload-8b-h100 200 build/fsdp-run --gpu -n 1 build/fsdp-train --model 8b --seq 2048 --batch 2 \
      --param-dtype bf16 --cpu-offload --optimizer-in-backward --clip 0 --steps 6 --log "$work/offload-8b-h100.jsonl"
    phase device-8b-h100 60 build/fsdp-run --gpu -n 1 build/fsdp-train --model 8b --seq 2048 --batch 1 \
      --param-dtype bf16 --recompute --steps 3 --log "$work/device-8b-h100.jsonl" ;;
  guarded-8b-1gpu)
    guard="python3 bench/host_memory_guard.py --min-available-gib 8 --out"
    phase fsdp2-offload-8b-1gpu 240 $guard "$work/fsdp2-offload-8b-1gpu.guard.json" -- python3 -m \
      torch.distributed.run --standalone --nproc-per-node=1 bench/fsdp2_llama.py --model 8b --seq 2048 --batch 2 \
      --steps 3 --cpu-offload --jsonl "$work/fsdp2-offload-8b-1gpu.jsonl"
    phase offload-8b-1gpu 200 $guard "$work/offload-8b-1gpu.guard.json" -- build/fsdp-run --gpu -n 1 \
      build/fsdp-train --model 8b --seq 2048 --batch 2 --param-dtype bf16 --cpu-offload --optimizer-in-backward \
      --clip 0 --steps 3 --log "$work/offload-8b-1gpu.jsonl" ;;
  offload-1b-1gpu)
    phase gpu-tests 240 ctest --test-dir build --output-on-failure \
      -R '^(unit|gpu_1_ranks|train_gpu_1|train_gpu_1_recompute|train_gpu_1_offload|train_gpu_1_optimizer_in_backward)$'
    one_gpu_1b="--model 1b --seq 2048 --batch 4 --steps 8"
    phase offload-1b-1gpu 120 build/fsdp-run --gpu -n 1 build/fsdp-train $one_gpu_1b --param-dtype bf16 \
      --cpu-offload --log "$work/offload-1b-1gpu.jsonl"
    for pending in 0 2; do
      phase offload-1b-1gpu-in-backward-pending$pending 120 build/fsdp-run --gpu -n 1 build/fsdp-train $one_gpu_1b \
        --param-dtype bf16 --cpu-offload --optimizer-in-backward --clip 0 --max-pending-host-steps $pending \
        --log "$work/offload-1b-1gpu-in-backward-pending$pending.jsonl"
    done
    phase fsdp2-offload-1b-1gpu 150 python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
      bench/fsdp2_llama.py $one_gpu_1b --cpu-offload --jsonl "$work/fsdp2-offload-1b-1gpu.jsonl" ;;
  hsdp)
    phase gpu-tests 240 ctest --test-dir build --output-on-failure \
      -R '^(gpu_2_ranks|train_gpu_2|train_gpu_2_recompute|train_gpu_2_offload|train_gpu_2_hsdp)$'
    phase hsdp-resume 120 bash -c "build/fsdp-run --gpu -n 2 build/fsdp-train --model tiny --seq 64 --steps 10 \
      --replicas 2 --save-dir $work/ckpt --log $work/hsdp-save.jsonl && build/fsdp-run --gpu -n 2 \
      build/fsdp-train --model tiny --seq 64 --steps 20 --resume $work/ckpt --log $work/fsdp-resume.jsonl"
    for replicas in 1 2; do
      phase hsdp-1b-r$replicas 120 build/fsdp-run --gpu -n 2 build/fsdp-train --model 1b --seq 2048 --batch 4 \
        --param-dtype bf16 --replicas $replicas --steps 10 --trace "$work/trace-1b-r$replicas" --trace-steps 1 \
        --log "$work/hsdp-1b-r$replicas.jsonl"
    done ;;
  two-nodes)
    phase gpu-tests 240 ctest --test-dir build --output-on-failure \
      -R '^(unit|gpu_2_ranks|train_gpu_2|train_gpu_2_recompute|train_gpu_2_offload|train_gpu_2_hsdp)$'
    phase torchrun-1-node 120 python3 -m torch.distributed.run --nproc-per-node 2 --no-python -- build/fsdp-train \
      --model tiny --seq 64 --steps 20 --log "$work/torchrun-1-node.jsonl"
    for replicas in 1 2; do
      phase two-nodes-r$replicas 120 bash bench/two_nodes_on_one_host.sh 1 $((29610 + replicas)) build/fsdp-train \
        --model tiny --seq 64 --steps 20 --replicas $replicas --log "$work/two-nodes-r$replicas.jsonl"
    done ;;
  package)
    phase gpu-tests 300 ctest --test-dir build --output-on-failure -R '^(unit|gpu_2_ranks|train_gpu_2|'\
'train_gpu_2_recompute|train_gpu_2_offload|train_gpu_2_hsdp|example_mlp|example_gpt2|subproject_configure)$'
    phase train-1b 120 build/fsdp-run --gpu -n 2 build/fsdp-train --model 1b --seq 2048 --batch 4 --param-dtype bf16 \
      --steps 10 --log "$work/train-1b.jsonl" ;;
  *) echo "unknown part '$part'"; exit 2 ;;
esac
