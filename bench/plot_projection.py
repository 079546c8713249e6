"""The projection's curves from a record's summary.jsonl (its `projected` rows, written from
fsdp-train --project reports): tokens/s a GPU and peak memory a GPU against the GPU count, per
model, sequence length and shape (FSDP, HSDP a replica a host), with torchtitan's published 8B
FSDP runs beside them and the card's memory as a line; a point whose peak is above the card's
memory has no speed. For docs/planner.md.

    python3 bench/plot_projection.py bench/results/2026-11-28-h200x2-7d65f26/summary.jsonl /tmp/projection.png
"""
import argparse
import collections
import json

# torchtitan's published performance page (pytorch/torchtitan): Llama 3.1 8B, FSDP, seq 8192, local
# batch 2, selective activation checkpointing, eager; H100s (96 GB, 500 W), 8 a host, 400 Gb/s a GPU.
# (GPUs, tokens/s/GPU)
TORCHTITAN_8B = [(8, 5762), (128, 5605)]
H200_GIB = 143771 / 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary")
    p.add_argument("out")
    args = p.parse_args()
    curves = collections.defaultdict(list)
    for line in open(args.summary):
        row = json.loads(line)
        if row.get("part") == "projected" and row["gpus"] >= 8:
            shape = "FSDP" if row["shape"] == "FSDP" else "HSDP"
            curves[f"{row['model'].upper()}, seq {row['seq']}, {shape}"].append(row)
    if not curves:
        raise SystemExit(f"plot_projection: {args.summary} has no projected rows of 8 GPUs or more")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 5.6))
    for label, rows in sorted(curves.items()):
        rows.sort(key=lambda r: r["gpus"])
        gpus = [r["gpus"] for r in rows]
        style = "-" if label.endswith("FSDP") else "--"
        fits = [r if r["peak_gib"] <= H200_GIB else None for r in rows]
        line, = memory.plot(gpus, [r["peak_gib"] for r in rows], style, marker="o", markersize=3, label=label)
        speed.plot(gpus, [r["tokens_s_gpu"] if r else float("nan") for r in fits], style, marker="o",
                   markersize=3, color=line.get_color())
    speed.plot(*zip(*TORCHTITAN_8B), "k*", markersize=10, label="torchtitan 8B, seq 8192, FSDP (published, H100)")
    memory.axhline(H200_GIB, color="k", linewidth=0.8, linestyle=":", label="an H200's memory")
    for ax, title in ((speed, "tokens/s a GPU (every block recomputed)"), (memory, "peak allocated a GPU (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (8 a host, 50 GB/s a GPU between hosts)")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
    handles = [h for ax in (memory, speed) for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(args.out, dpi=100)
    print(f"plot_projection: {args.out}: {len(curves)} curves")


if __name__ == "__main__":
    main()
