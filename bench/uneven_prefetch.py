"""A prefetch depth of a group's own where module times vary, measured: a stack
of MLP blocks where every --period-th is --large times wider than the others, each block and the
root sharded by fsdpcpp, planned by fsdpcpp.plan_memory_budget for --budget-gib, then trained in
alternating rounds under the plan as made and under the plan with every block back on the root's
prefetch depth (--fixed: no planner; depth 1, depth 2, and depth 1 with each large block gathered
two blocks ahead by the blocks' own depths). Prints each side's median step (the median of its
rounds' medians, each without its first --warmup steps), peak allocated memory and prefetches a
step.

    build/fsdp-run -n 4 --gpu build/python bench/uneven_prefetch.py --jsonl /tmp/uneven.jsonl
    build/fsdp-run -n 4 --gpu build/python bench/uneven_prefetch.py --fixed
    build/fsdp-run -n 2 --cpu build/python bench/uneven_prefetch.py --width 32 --blocks 6 --steps 3 --rounds 1 --warmup 1
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

import fsdpcpp

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--width", type=int, default=4096, help="the blocks' input and output width")
parser.add_argument("--blocks", type=int, default=12)
parser.add_argument("--period", type=int, default=3, help="every this many blocks one is large")
parser.add_argument("--large", type=int, default=16, help="a large block's hidden width over --width (small: 1)")
parser.add_argument("--tokens", type=int, default=8192, help="tokens a rank a step")
parser.add_argument("--budget-gib", type=float, default=0, help="the planner's budget (default: the device's memory)")
parser.add_argument("--fixed", action="store_true", help="no planner: depth 1, depth 2, and depth 1 with the "
                    "large blocks gathered two blocks ahead")
parser.add_argument("--steps", type=int, default=10, help="steps a side a round")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--warmup", type=int, default=2, help="steps of each round left out of its median")
parser.add_argument("--jsonl", help="rank 0 appends a row per side")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden, bias=False), nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(args.width, args.width * (args.large if i % args.period == args.period - 1 else 1))
            for i in range(args.blocks))
        self.norm = nn.LayerNorm(args.width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


fsdpcpp.init()
device, rank = fsdpcpp.device(), fsdpcpp.rank()
on_gpu = device.type == "cuda"
torch.manual_seed(0)
model = Stack().to(device)
mp = fsdpcpp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else fsdpcpp.MixedPrecisionPolicy()
for block in model.blocks:
    fsdpcpp.fully_shard(block, mp_policy=mp)
fsdpcpp.fully_shard(model, mp_policy=mp)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu)
generator = torch.Generator(device="cpu").manual_seed(1 + rank)
batches = [torch.randn(args.tokens, args.width, generator=generator).to(device) for _ in range(4)]
steps = 0


def train_step():
    global steps
    loss = model(batches[steps % len(batches)]).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    steps += 1
    return loss.item()


groups = {name or "root": m for name, m in model.named_modules() if isinstance(m, fsdpcpp.FSDPModule)}
if args.fixed:
    # Depth 1 everywhere; 2 everywhere; and 1 but for the blocks two before a large one in forward
    # and two after it (two before in backward), whose start gathers it a block earlier.
    large = [i for i in range(args.blocks) if i % args.period == args.period - 1]
    early = {f"blocks.{j}": 2 for i in large for j in (i - 2, i + 2) if 0 <= j < args.blocks}
    sides = {"depth 1": (1, {}), "depth 2": (2, {}), "depth 1, large blocks gathered two ahead": (1, early)}
    train_step()  # records the order prefetching follows
else:
    budget = int(args.budget_gib * 2**30) if args.budget_gib else (
        torch.cuda.get_device_properties(device).total_memory if on_gpu else 64 << 30)
    plan = fsdpcpp.plan_memory_budget(model, train_step, budget)  # prints the plan
    own, depth = plan.prefetch_depths, plan.runtime_options["prefetch_depth"]
    sides = {"plan": (depth, own), "plan without own depths": (depth, {})}
    if rank == 0 and not own:
        print("uneven_prefetch: the plan deepens no group's prefetch: both sides run the same schedule", flush=True)


def run_side(depth: int, own: dict):
    """--steps steps with the root's prefetch depth `depth` and the groups named in `own` at their
    own depth: the median step after --warmup, the peak allocated bytes, prefetches a step."""
    model.set_runtime_options(prefetch_depth=depth)
    for name, module in groups.items():
        module._fsdpcpp.group.set_prefetch_depth(own.get(name, -1))
    fsdpcpp.reset_peak_allocated()
    prefetches = fsdpcpp.runtime_stats()["prefetches"]
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step()  # ends on loss.item(), which waits for the device
        times.append((time.perf_counter() - start) * 1e3)
    return (statistics.median(times[args.warmup:]), fsdpcpp.allocated_bytes()["peak"],
            (fsdpcpp.runtime_stats()["prefetches"] - prefetches) / args.steps)


runs = {name: [] for name in sides}
for _ in range(args.rounds):
    for name, (depth, own) in sides.items():
        runs[name].append(run_side(depth, own))
if rank == 0:
    for name, measured in runs.items():
        depth, own = sides[name]
        row = {"side": name, "prefetch_depth": depth, "own_depths": own, "step_ms": statistics.median(r[0] for r in measured),
               "rounds_ms": [round(r[0], 2) for r in measured], "peak_alloc_gib": max(r[1] for r in measured) / 2**30,
               "prefetches_per_step": measured[0][2], "world": fsdpcpp.world_size(), "args": vars(args)}
        print(f"uneven_prefetch: {name}: median step {row['step_ms']:.1f} ms ({', '.join(map(str, row['rounds_ms']))}), "
              f"peak allocated {row['peak_alloc_gib']:.2f} GiB, {row['prefetches_per_step']:.0f} prefetches a step", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
fsdpcpp.shutdown()
