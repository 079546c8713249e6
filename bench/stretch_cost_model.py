"""A cost model of a few blocks (fsdp-train --cost-model on a bench/llama_slice.py folder) carried to
the whole model's block count, for fsdp-train --project (the 70B's 80 blocks from
4 measured on 2 GPUs).

    python3 bench/stretch_cost_model.py COST.json --blocks 80 --out COST-80.json

What it assumes, beside the projection's own model (include/fsdp/plan/projection.h):
  - every block costs what the measured blocks cost: each added block is their median, field by
    field (times, peaks, buffer sizes); the root group (embedding, final norm, head) is kept as
    measured, its shapes being the whole model's;
  - the sharded state (fp32 weights and AdamW's moments: the part of fixed_bytes that
    sharded_fixed_bytes says) grows with the parameters, a block's share in proportion to its
    parameter bytes;
  - the time outside the groups (fixed_ms: mostly the optimizer step over the sharded state)
    grows with the parameters too.
"""
import argparse
import copy
import json
import os
import statistics


def median_block(blocks):
    """Each numeric field the median over `blocks`; the rest as the first has it."""
    out = copy.deepcopy(blocks[0])
    for key, value in out.items():
        if isinstance(value, dict):
            out[key] = median_block([b[key] for b in blocks])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            m = statistics.median(b[key] for b in blocks)
            out[key] = round(m) if isinstance(value, int) else m
    return out


def stretch(measured, blocks):
    model = measured["model"]
    groups = model["groups"]
    measured_blocks = [g for g in groups if g["recomputable"]]
    if not measured_blocks or not all(g["recomputable"] for g in groups[-len(measured_blocks):]):
        raise SystemExit("stretch_cost_model: the groups are not one root then blocks; give a cost model of a "
                         "Llama (fsdp-train --cost-model)")
    if blocks < len(measured_blocks):
        raise SystemExit(f"stretch_cost_model: --blocks {blocks} is fewer than the {len(measured_blocks)} measured")
    typical = median_block(measured_blocks)
    added = []
    for i in range(len(measured_blocks), blocks):
        block = copy.deepcopy(typical)
        block["name"] = f"blocks.{i}"
        added.append(block)
    old_params = sum(g["memory"]["param_bytes"] for g in groups)
    new_params = old_params + sum(b["memory"]["param_bytes"] for b in added)
    out = copy.deepcopy(measured)
    out["model"]["groups"] = groups + added
    grown = measured["sharded_fixed_bytes"] * (new_params / old_params - 1)
    out["sharded_fixed_bytes"] = measured["sharded_fixed_bytes"] + round(grown)
    out["model"]["fixed_bytes"] = model["fixed_bytes"] + round(grown)
    out["model"]["fixed_ms"] = model["fixed_ms"] * new_params / old_params
    return out, len(measured_blocks), new_params / old_params


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cost_model", help="a file fsdp-train --cost-model wrote")
    p.add_argument("--blocks", type=int, required=True, help="the whole model's block count")
    p.add_argument("--out", required=True, help="a new file (nothing is overwritten)")
    args = p.parse_args()
    if os.path.exists(args.out):
        p.error(f"--out {args.out} exists: give a new file")
    out, measured, growth = stretch(json.load(open(args.cost_model)), args.blocks)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"stretch_cost_model: {args.out}: {measured} measured blocks carried to {args.blocks}; "
          f"parameters and sharded state x{growth:.2f}")


if __name__ == "__main__":
    main()
