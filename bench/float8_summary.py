#!/usr/bin/env python3
"""Tables (Markdown) of bench/gpu_float8.sh's runs.

  python3 bench/float8_summary.py OUT          speed: per model and precision, the median over
      rounds of each run's median step time (steps 6-15: the first five include compilation and
      the allocator's warm-up), tokens/s, MFU in bf16-equivalent FLOPs (the same FLOPs whatever the
      operands' format: fsdp-train's flops_per_token, against each GPU's dense bf16 peak), peak
      allocated/reserved and the ratios to fsdp.cpp bf16 and to FSDP2 + torchao float8 + compile
  python3 bench/float8_summary.py --loss OUT   loss: training loss (mean of the last 50 steps) and
      held-out loss of float8 against bf16, and a plot (loss-curves.png)
"""
import glob
import math
import os
import re
import statistics
import sys

import step_log
from presets import hf_presets

PRECISIONS = ("off", "tensorwise", "tensorwise-cast", "rowwise")  # the loss runs' variants, in order
PEAK_BF16 = {"H200": 989e12, "H100": 989e12}  # dense bf16 tensor-core FLOP/s of SXM Hopper parts
# Model dims (fsdp-train's presets, trainer/model/presets.json) for the FLOPs of FSDP2 runs, whose
# logs lack flops_per_token.
DIMS = {name: dict(vocab=c["vocab_size"], dim=c["hidden_size"], layers=c["num_hidden_layers"],
                   kv=c["num_key_value_heads"], heads=c["num_attention_heads"], ffn=c["intermediate_size"])
        for name, c in hf_presets().items()}


def flops_per_token(model, seq):
    d = DIMS[model]
    kv = d["kv"] * d["dim"] // d["heads"]
    block = 2 * d["dim"] ** 2 + 2 * d["dim"] * kv + 3 * d["dim"] * d["ffn"]
    # As LlamaConfig::flops_per_token: matrix products' weights, the head once, tied or not.
    return 6.0 * (d["layers"] * block + d["vocab"] * d["dim"]) + 6.0 * d["layers"] * seq * d["dim"]


def gpu_peak(out):
    env = open(glob.glob(f"{out}/env-*.txt")[0]).read()
    return next((v for k, v in PEAK_BF16.items() if k in env), 989e12)


def speed(out):
    peak = gpu_peak(out)
    runs = {}
    for path in sorted(glob.glob(f"{out}/*-*-[0-9]*.jsonl")):
        m = re.fullmatch(r"(1b|3b)-(off|tensorwise|tensorwise-cast|rowwise|torchao-tensorwise|torchao-rowwise)-(\d+)\.jsonl",
                         os.path.basename(path))
        if not m:
            continue
        steps = step_log.read(path)[5:]
        if not steps:
            continue
        runs.setdefault((m[1], m[2]), []).append(steps)
    print("| model | precision | runs | step ms (median) | tokens/s | MFU | x fsdp.cpp bf16 | x torchao float8 | "
          "peak alloc / reserved GiB | reserved / alloc | loss at the last step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    table = {}
    for (model, precision), runs_of in sorted(runs.items()):
        ms = statistics.median(step_log.median_step_ms(steps, 0) for steps in runs_of)
        last = runs_of[-1][-1]
        tokens = last.get("tokens_per_step") or (last["tok_s"] * last["step_ms"] / 1000)
        seq = 2048
        fpt = last.get("flops_per_token") or flops_per_token(model, seq)
        table[(model, precision)] = dict(ms=ms, tokens=tokens, fpt=fpt, world=last.get("world", 1), alloc=max(s[-1]["peak_alloc_gib"] for s in runs_of),
                                         reserved=max(s[-1]["peak_reserved_gib"] for s in runs_of), loss=last["loss"],
                                         runs=len(runs_of))
    for (model, precision), t in sorted(table.items()):
        tok_s = t["tokens"] / (t["ms"] / 1000)
        base = table.get((model, "off"))
        ao = table.get((model, "torchao-tensorwise"))
        name = {"off": "fsdp.cpp bf16", "tensorwise": "fsdp.cpp float8 tensorwise (float8 all-gather)",
                "tensorwise-cast": "fsdp.cpp float8 tensorwise (bf16 all-gather, cast after)",
                "rowwise": "fsdp.cpp float8 rowwise",
                "torchao-tensorwise": "FSDP2 + torchao float8 tensorwise + compile",
                "torchao-rowwise": "FSDP2 + torchao float8 rowwise + compile"}[precision]
        ratio = lambda other: f"{other['ms'] / t['ms']:.3f}" if other else "-"
        print(f"| {model} | {name} | {t['runs']} | {t['ms']:.1f} | {tok_s:,.0f} | {t['fpt'] * tok_s / (peak * t['world']):.1%} | "
              f"{ratio(base)} | {ratio(ao)} | {t['alloc']:.2f} / {t['reserved']:.2f} | "
              f"{t['reserved'] / t['alloc']:.3f} | {t['loss']:.4f} |")


def loss(out):
    print("| model | precision | steps | training loss (mean of the last 50 steps) | minus bf16's | "
          "held-out loss at the end | minus bf16's |")
    print("|---|---|---|---|---|---|---|")
    curves = {}
    for model in ("small", "1b"):
        base = None
        for precision in PRECISIONS:
            path = f"{out}/loss-{model}-{precision}.jsonl"
            if not os.path.exists(path):
                continue
            r = step_log.read(path)
            curves[(model, precision)] = r
            train = statistics.mean(x["loss"] for x in r[-50:])
            held = [x["eval_loss"] for x in r if "eval_loss" in x]
            held = held[-1] if held else math.nan
            if precision == "off":
                base = (train, held)
            d = (train - base[0], held - base[1]) if base else (math.nan, math.nan)
            print(f"| {model} | {'bf16' if precision == 'off' else 'float8 ' + precision} | {len(r)} | {train:.4f} | "
                  f"{d[0]:+.4f} | {held:.4f} | {d[1]:+.4f} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({m for m, _ in curves}, key=("small", "1b").index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for precision in PRECISIONS:
            r = curves.get((model, precision))
            if not r:
                continue
            window = 20
            smooth = [statistics.mean(x["loss"] for x in r[max(0, i - window + 1):i + 1]) for i in range(len(r))]
            ax.plot([x["step"] for x in r], smooth, label="bf16" if precision == "off" else f"float8 {precision}")
        ax.set_title(f"{model}: training loss on the Vim help text (mean of {window} steps)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per byte)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}/loss-curves.png", dpi=110)


if __name__ == "__main__":
    if sys.argv[1] == "--loss":
        loss(sys.argv[2])
    else:
        speed(sys.argv[1])
