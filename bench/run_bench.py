"""fsdp.cpp vs what PyTorch users run instead, back to back on the same GPUs, from the same
initial weights and data: FSDP2 eager (pytorch-fsdp2), FSDP2 with torch.compile on each block
(pytorch-fsdp2-compile) and, for the small model, DDP (pytorch-ddp), all with
bench/fsdp2_llama.py's model. Writes results.jsonl (one row per run) and results.md to --out.

    python3 bench/run_bench.py --out DIR --commit SHA [--configs 1b,small] [--steps 13]
    python3 bench/run_bench.py --out DIR --configs 1b,1b-ac,8b,8b-ac --worlds 2,4,8   # scaling
    python3 bench/run_bench.py --out DIR --configs 1b,1b-ac --repeats 3   # FSDP2's speed varies by
                                                                          # up to 20% run to run
    python3 bench/run_bench.py --out DIR --configs 1b --combine RUN1 RUN2   # tables only

Each run takes --steps timed steps (the first 3 are warm-up, the rest give
medians), then --profile-steps more under the PyTorch profiler. From rank 0's
profile (bench/profile_summary.py), per step: exposed_comm_ms, the time an NCCL
kernel ran while no compute kernel did; gpu_idle_ms, the time no kernel ran.
fsdp-train also traces its warm-up steps 2-3 (--trace): from rank 0's host track
(bench/trace_overlap.py) cpu_lead_ms, the median time from the CPU issuing a
block's compute to the GPU starting it, groups_ahead_max, the most groups with compute
issued and not yet started, and cap_waits, the CPU's waits on the in-flight caps.
profiles.md has each run's profile: the GPU time by kind of kernel (matrix products,
attention, communication, optimizer, copies and casts, norms, the rest), the rate of
its matrix products and attention in TFLOP/s, and its costliest kernels.
"""
import argparse
import collections
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch

import profile_summary
import step_log
import trace_overlap

H200_BF16_DENSE_FLOPS = 989.4e12  # per GPU, the MFU denominator
WARMUP = 3
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
# fsdp-train turns expandable segments on unless the environment says otherwise (what
# keeps reserved near allocated, the allocator's segments or the runtime's stream order).
FIXED_SEGMENTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
SLOW_NCCL = {"NCCL_MAX_NCHANNELS": "1", "NCCL_MIN_NCHANNELS": "1", "NCCL_PROTO": "Simple"}
CONFIGS = {
    # name: (preset, seq, batch per GPU, extra flags for both systems, extra environment)
    "1b": ("1b", 2048, 4, [], {}),
    "1b-ac": ("1b", 2048, 4, ["--recompute"], {}),
    # Expandable segments on both sides (fsdp-train's default since 3cf0cd8's runs; so
    # "1b" compares each system's default allocator settings).
    "1b-es": ("1b", 2048, 4, [], EXPANDABLE),
    "1b-ac-es": ("1b", 2048, 4, ["--recompute"], EXPANDABLE),
    "1b-noes": ("1b", 2048, 4, [], FIXED_SEGMENTS),
    "1b-ac-noes": ("1b", 2048, 4, ["--recompute"], FIXED_SEGMENTS),
    # No cap on reduce-scatters in flight (the compute stream never waits for the oldest).
    "1b-rs-nolimit": ("1b", 2048, 4, ["--max-inflight-reduce-scatters", "0"], {}),
    "1b-depth0": ("1b", 2048, 4, ["--prefetch-depth", "0"], {}),
    "1b-depth2": ("1b", 2048, 4, ["--prefetch-depth", "2"], {}),
    "1b-nolimit": ("1b", 2048, 4, ["--max-inflight-allgathers", "0"], {}),
    "1b-depth4": ("1b", 2048, 4, ["--prefetch-depth", "4"], {}),
    "1b-depth4-nolimit": ("1b", 2048, 4, ["--prefetch-depth", "4", "--max-inflight-allgathers", "0"], {}),
    # The all-gather cap where the CPU has the most room to run ahead: NCCL held to one
    # channel and its simple protocol, so each block's all-gather outlasts its compute and the GPU
    # falls behind the CPU; at prefetch depth 1 and 4, capped (default 2) and not (0).
    "1b-slow": ("1b", 2048, 4, [], SLOW_NCCL),
    "1b-slow-nolimit": ("1b", 2048, 4, ["--max-inflight-allgathers", "0"], SLOW_NCCL),
    "1b-slow-depth4": ("1b", 2048, 4, ["--prefetch-depth", "4"], SLOW_NCCL),
    "1b-slow-depth4-nolimit": ("1b", 2048, 4, ["--prefetch-depth", "4", "--max-inflight-allgathers", "0"], SLOW_NCCL),
    # Where else running ahead could hurt: many small groups (the small model's 24
    # blocks of 3.2 M parameters), and CPU offload (each all-gather waits on a host-to-device copy).
    "small-nolimit": ("small", 512, 2, ["--max-inflight-allgathers", "0"], {}),
    "1b-offload": ("1b", 2048, 4, ["--cpu-offload"], {}),
    "1b-offload-nolimit": ("1b", 2048, 4, ["--cpu-offload", "--max-inflight-allgathers", "0"], {}),
    # The loss-agreement check at a learning rate where 1B training is not chaotic:
    # at 3e-4 the loss climbs back after step 4 with gradient norms of 25-40 and
    # two runs of one system end up to 0.09 apart by step 15.
    "1b-lowlr": ("1b", 2048, 4, ["--lr", "1e-4", "--min-lr", "1e-5"], {}),
    "small": ("small", 512, 2, [], {}),
    # The small model with FlashAttention-2 instead of ATen's choice (cuDNN on Hopper).
    "small-flash": ("small", 512, 2, ["--attention", "flash"], {}),
    "small-bucket16": ("small", 512, 2, ["--bucket-mb", "16"], {}),
    "tiny": ("tiny", 64, 4, [], {}),  # the CPU smoke test of this script (--cpu)
    # The scaling run: these and the 1B ones on 2, 4 and 8 GPUs.
    "3b": ("3b", 2048, 2, [], {}),
    "8b": ("8b", 2048, 2, [], {}),
    "8b-ac": ("8b", 2048, 2, ["--recompute"], {}),
    "8b-ac-nolimit": ("8b", 2048, 2, ["--recompute", "--max-inflight-allgathers", "0"], {}),
    "8b-ac-noes": ("8b", 2048, 2, ["--recompute"], FIXED_SEGMENTS),
    # Reserved over allocated with recomputation, bf16 and float8 (the target of 1.05).
    "3b-ac": ("3b", 2048, 2, ["--recompute"], {}),
    "3b-ac-fp8": ("3b", 2048, 2, ["--recompute", "--fp8", "tensorwise"], {}),
    "8b-ac-fp8": ("8b", 2048, 2, ["--recompute", "--fp8", "tensorwise"], {}),
    # transformers' own Llama of the 1B's shapes under FSDP2 and fsdpcpp; with
    # --recompute, transformers' gradient checkpointing (fsdp-train recomputes its own blocks).
    "1b-hf": ("1b", 2048, 4, [], {}),
    "1b-hf-ac": ("1b", 2048, 4, ["--recompute"], {}),
    # The 8B's shapes on one GPU: its first 8 of 32 blocks (preset "slice-MODEL-BLOCKS": made by
    # bench/llama_slice.py into --out, read by fsdp-train --init-from and fsdp2_llama.py --model).
    "8b-8l": ("slice-8b-8", 2048, 2, [], {}),
    # The same in float8 (tensorwise, float8 all-gather): fsdp-train's own, torchao's under FSDP2
    # (the torchao wheel installed), fsdpcpp.float8's under fsdpcpp; "-fp8" configs are also
    # compared with the config they add float8 to.
    "8b-8l-fp8": ("slice-8b-8", 2048, 2, ["--fp8", "tensorwise"], {}),
    "tiny-fp8": ("tiny", 64, 4, ["--fp8", "tensorwise"], {}),  # the CPU check of fsdpcpp.float8's path
    "tiny-2l": ("slice-tiny-2", 64, 4, [], {}),  # the CPU check of the slice path
    # Tensor parallelism: fsdp-train --tp against FSDP2 + torch's tensor parallelism (torchtitan's
    # plan; fsdp2_llama.py --tp). The batch is per tp group: tp x the 8B's 2 keeps a GPU's tokens.
    "8b-tp2": ("8b", 2048, 4, ["--tp", "2"], {}),
    "8b-tp4": ("8b", 2048, 8, ["--tp", "4"], {}),
    "tiny-tp2": ("tiny", 64, 4, ["--tp", "2"], {}),  # the CPU check of the tp path (same weights: same losses)
}
# The PyTorch systems: name -> (log name, fsdp2_llama.py flags).
PYTORCH_SYSTEMS = {
    "pytorch-fsdp2": ("fsdp2", []),
    "pytorch-fsdp2-compile": ("fsdp2c", ["--compile"]),
    "pytorch-ddp": ("ddp", ["--ddp"]),
    # FSDP1 with its rate limiter on (its default) and off: the cap fairscale #1052 asked for.
    "pytorch-fsdp1": ("fsdp1", ["--fsdp1"]),
    "pytorch-fsdp1-nolimit": ("fsdp1nl", ["--fsdp1", "--no-limit-all-gathers"]),
    # The same script sharded by fsdp.cpp's Python package: only the import changes.
    "fsdpcpp-python": ("fsdpcppy", ["--runtime", "fsdpcpp"]),
    "fsdpcpp-python-compile": ("fsdpcppyc", ["--runtime", "fsdpcpp", "--compile"]),
    # transformers' LlamaForCausalLM instead of the script's model, under each runtime.
    "hf-fsdp2": ("hffsdp2", ["--hf"]),
    "hf-fsdp2-compile": ("hffsdp2c", ["--hf", "--compile"]),
    "hf-fsdpcpp": ("hffsdpcppy", ["--hf", "--runtime", "fsdpcpp"]),
    "hf-fsdpcpp-compile": ("hffsdpcppyc", ["--hf", "--runtime", "fsdpcpp", "--compile"]),
}
PYTHON_FRONT_END = ["fsdpcpp-python", "fsdpcpp-python-compile", "hf-fsdpcpp", "hf-fsdpcpp-compile"]
# Each of the Python front end's systems is compared with FSDP2 run the same way.
PYTHON_PAIRS = [("fsdpcpp-python", "pytorch-fsdp2"), ("fsdpcpp-python-compile", "pytorch-fsdp2-compile"),
                ("hf-fsdpcpp", "hf-fsdp2"), ("hf-fsdpcpp-compile", "hf-fsdp2-compile")]
# Beside each ratio of fsdp.cpp over a PyTorch system, the runtime's alone: the same script under
# fsdpcpp over it (the same model, only the sharding runtime differs).
RUNTIME_ONLY = {theirs: ours for ours, theirs in PYTHON_PAIRS}
# Systems that make their own initial weights (transformers' init, the same seed under either
# runtime): their losses are compared only with each other's.
OWN_INIT_SYSTEMS = {"hf-fsdp2", "hf-fsdp2-compile", "hf-fsdpcpp", "hf-fsdpcpp-compile"}
SAVED_INITS = set()
# Presets whose full weights are too large to hand over in one file (3B: 13 GB, 8B: 32 GB): each
# system makes its own initial weights, of the same distribution, so their losses are not compared.
OWN_INIT_PRESETS = {"3b", "8b"}


def shares_init(preset):
    """Whether every system starts from fsdp-train's initial weights (--save-init): not for the
    presets above, nor a slice (fsdp-train reads its weights, the others make their own)."""
    return preset not in OWN_INIT_PRESETS and not preset.startswith("slice-")
EAGER_AND_COMPILED = ["pytorch-fsdp2", "pytorch-fsdp2-compile"]
FSDP1 = ["pytorch-fsdp1", "pytorch-fsdp1-nolimit"]
# The PyTorch systems each config runs against (configs not here are fsdp.cpp knobs).
REFERENCES = {
    "1b": EAGER_AND_COMPILED + FSDP1 + PYTHON_FRONT_END, "1b-ac": EAGER_AND_COMPILED + FSDP1 + PYTHON_FRONT_END,
    "1b-es": ["pytorch-fsdp2", "fsdpcpp-python"], "1b-ac-es": ["pytorch-fsdp2", "fsdpcpp-python"],
    "1b-lowlr": ["pytorch-fsdp2"],
    "small": EAGER_AND_COMPILED + ["pytorch-ddp"] + PYTHON_FRONT_END, "8b": EAGER_AND_COMPILED + PYTHON_FRONT_END,
    "3b": EAGER_AND_COMPILED + ["fsdpcpp-python", "fsdpcpp-python-compile"],  # transformers' config lacks its RoPE scaling
    "8b-ac": ["pytorch-fsdp2", "fsdpcpp-python"],
    "tiny": EAGER_AND_COMPILED + FSDP1 + ["pytorch-ddp", "hf-fsdp2", "hf-fsdpcpp"],
    "1b-hf": sorted(OWN_INIT_SYSTEMS), "1b-hf-ac": sorted(OWN_INIT_SYSTEMS),
    "8b-8l": EAGER_AND_COMPILED + ["fsdpcpp-python-compile"], "tiny-2l": ["pytorch-fsdp2"],
    "8b-8l-fp8": ["pytorch-fsdp2-compile", "fsdpcpp-python-compile"], "tiny-fp8": ["fsdpcpp-python"],
    "8b-tp2": EAGER_AND_COMPILED + ["fsdpcpp-python-compile"], "8b-tp4": EAGER_AND_COMPILED + ["fsdpcpp-python-compile"],
    "tiny-tp2": ["pytorch-fsdp2", "fsdpcpp-python"],
}

def run(cmd, log_path, env):
    print("+", " ".join(f"{k}={v}" for k, v in env.items()), " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **env))
    if done.returncode != 0:
        print(open(log_path).read()[-3000:], flush=True)
        raise SystemExit(f"failed: {' '.join(cmd)}")


def summarize(jsonl, world, steps, profile):
    rows = step_log.read(jsonl)
    measured = step_log.timed(rows[:steps], WARMUP)
    traces = [profile + "-rank0.json" + gz for gz in ("", ".gz") if os.path.exists(profile + "-rank0.json" + gz)]
    prof = profile_summary.summarize(traces[0]) if traces else None
    step_ms = step_log.median_step_ms(measured, 0)
    return dict(
        step_ms=step_ms,
        tok_s_gpu=statistics.median(r["tok_s"] for r in measured) / world,
        peak_alloc_gib=max(r["peak_alloc_gib"] for r in measured),
        peak_reserved_gib=max(r["peak_reserved_gib"] for r in measured),
        compiled_loss=rows[0].get("compiled_loss"),  # fsdp2_llama.py's: its loss compiled with the blocks
        loss_first=rows[0]["loss"],
        loss_last=rows[-1]["loss"],
        losses=[r["loss"] for r in rows],
        allgather_waits=sum(r.get("allgather_waits", 0) for r in measured),
        alloc_retries=sum(r.get("alloc_retries", 0) for r in measured),
        exposed_comm_ms=prof and prof["exposed_comm_ms"],
        gpu_idle_ms=prof and prof["idle_ms"],
        gpu_compute_ms=prof and prof["compute_ms"],
        profile=prof,
    )


def run_ahead(trace):
    """From rank 0's trace of fsdp-train's warm-up steps: how far ahead of the GPU the CPU ran and
    how it waited on the caps (bench/trace_overlap.py); nothing for a run without one."""
    path = trace + "-rank0.json"
    if not os.path.exists(path):
        return dict(cpu_lead_ms=None, groups_ahead_max=None, cap_waits={})
    s = trace_overlap.summarise(path)
    return dict(cpu_lead_ms=s["lead_ms_median"], groups_ahead_max=s["groups_ahead_max"], cap_waits=s["cap_waits"])


def ratio(a, b):
    """a / b for a table; CPU runs have no device memory (b = 0)."""
    return f"{a / b:.3f}" if b else "n/a"


def log_paths(folder, system, config, world, repeat):
    """(step log, profile prefix, trace prefix) of one run; repeats after the first get an -rN suffix."""
    name = f"{system}-{config}-w{world}" + (f"-r{repeat}" if repeat else "")
    return tuple(os.path.join(folder, prefix + name) for prefix in ("", "profile-", "trace-"))


def collect(config, world, folder, steps, repeat, logged_as=None):
    """The rows of one configuration's runs whose logs are in `folder` (under the
    names of repeat `logged_as`, by default `repeat`)."""
    logged_as = repeat if logged_as is None else logged_as
    log, profile, trace = log_paths(folder, "fsdpcpp", config, world, logged_as)
    row = dict(system="fsdp.cpp", config=config, world=world, repeat=repeat,
               **summarize(log + ".jsonl", world, steps, profile), **run_ahead(trace))
    row["flops_per_token"] = json.loads(open(log + ".jsonl").readline())["flops_per_token"]
    rows = [row]
    for system in REFERENCES.get(config, []):
        log2, profile2, _ = log_paths(folder, PYTORCH_SYSTEMS[system][0], config, world, logged_as)
        if os.path.exists(log2 + ".jsonl"):
            rows.append(dict(system=system, config=config, world=world, repeat=repeat,
                             flops_per_token=row["flops_per_token"], **summarize(log2 + ".jsonl", world, steps, profile2)))
    return rows

def slice_folder(preset, out):
    """A "slice-MODEL-BLOCKS" preset's Hugging Face folder in `out`, made the first time."""
    _, model, blocks = preset.split("-")
    folder = os.path.join(out, preset)
    if not os.path.isdir(folder):
        subprocess.run([sys.executable, "bench/llama_slice.py", "--model", model, "--layers", blocks, "--out", folder],
                       check=True)
    return folder


def run_config(config, world, args, repeat):
    """fsdp.cpp (and FSDP2 where the config has a reference) on `world` GPUs: one row each."""
    preset, seq, batch, flags, extra_env = CONFIGS[config]
    init = os.path.join(args.out, f"init-{preset}.pt")
    steps = args.steps + args.profile_steps
    sliced = slice_folder(preset, args.out) if preset.startswith("slice-") else None
    train = [*(["--init-from", sliced] if sliced else ["--model", preset]), "--steps", str(steps), "--seq", str(seq), "--batch",
             str(batch), "--lr", "3e-4", "--min-lr", "3e-5", "--param-dtype", "bf16",
             "--reduce-dtype", "fp32", "--profile-steps", str(args.profile_steps)]
    log, profile, trace = log_paths(args.out, "fsdpcpp", config, world, repeat)
    # Written by the first run of each preset in this invocation (a file left by an earlier one
    # may come from another model version).
    shared_init = shares_init(preset)
    save_init = ["--save-init", init] if shared_init and init not in SAVED_INITS else []
    if save_init:
        SAVED_INITS.add(init)
    run([os.path.join(args.build, "fsdp-run"), "--cpu" if args.cpu else "--gpu", "-n", str(world),
         os.path.join(args.build, "fsdp-train"), *train, *flags,
         *save_init, "--overwrite-log", "--log", log + ".jsonl",  # --out is the benchmark's: a rerun replaces
         "--profile", profile, "--trace", trace, "--trace-steps", "2"],
        log + ".log", extra_env)
    for system in REFERENCES.get(config, []):
        if args.systems and system not in args.systems.split(","):
            continue
        name, system_flags = PYTORCH_SYSTEMS[system]
        log2, profile2, _ = log_paths(args.out, name, config, world, repeat)
        # fsdp.cpp's CPU ranks are MPI processes: fsdp-run (mpirun) starts them; torchrun otherwise.
        launcher = ([os.path.join(args.build, "fsdp-run"), "--cpu", "-n", str(world), sys.executable]
                    if args.cpu and system in PYTHON_FRONT_END else
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"])
        run([*launcher, "bench/fsdp2_llama.py",
             "--model", sliced or preset, "--steps", str(steps), "--seq", str(seq), "--batch",
             str(batch), *flags, *system_flags,
             *(["--init", init] if shared_init and system not in OWN_INIT_SYSTEMS else []),
             "--jsonl", log2 + ".jsonl", "--profile", profile2,
             "--profile-steps", str(args.profile_steps)],
            log2 + ".log",
            dict(extra_env, PYTHONPATH=os.path.join(args.build, "py")) if system in PYTHON_FRONT_END else extra_env)
    return collect(config, world, args.out, args.steps, repeat)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--configs", default="1b,1b-ac,1b-depth0,1b-depth2,1b-nolimit,small")
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every configuration N times (both systems each time); the comparison "
                        "uses the median over the runs and shows the range of the per-run ratios")
    p.add_argument("--build", default="build", help="build folder with fsdp-run and fsdp-train")
    p.add_argument("--systems", help="only these PyTorch systems, e.g. pytorch-fsdp2,pytorch-ddp (default: all "
                                     "that each config has)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU ranks (MPI / gloo; 2 unless --worlds says otherwise): checks the script")
    p.add_argument("--worlds", help="GPU counts to run each config on, e.g. 2,4,8 (default: all GPUs); "
                                    "with several, the table adds weak-scaling efficiency")
    p.add_argument("--combine", nargs="+", metavar="DIR",
                   help="run nothing: read the runs of --configs that earlier invocations left in each "
                        "DIR (each run a repeat) and write the tables for them all to --out")
    args = p.parse_args()
    if args.cpu:  # CPU ranks on both sides even on a GPU machine (FSDP2 picks gloo, fsdp-train MPI)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.makedirs(args.out, exist_ok=True)
    results = combine(args) if args.combine else run_all(args)
    for r in results:
        r["mfu"] = r["flops_per_token"] * r["tok_s_gpu"] / H200_BF16_DENSE_FLOPS
    common = {k: ", ".join(dict.fromkeys(str(r[k]) for r in results)) for k in ("device", "torch", "commit", "date")}
    worlds = sorted({r["world"] for r in results})

    with open(os.path.join(args.out, "results.jsonl"), "w") as f:
        for r in results:
            f.write(json.dumps({k: v for k, v in r.items() if k != "profile"}) + "\n")
    with open(os.path.join(args.out, "profiles.md"), "w") as f:
        for r in results:
            if r["profile"]:
                f.write(profile_markdown(r))
    write_markdown(results, worlds, os.path.join(args.out, "results.md"), common)


def run_all(args):
    gpus = 2 if args.cpu else torch.cuda.device_count()
    common = dict(device="CPU" if args.cpu else f"{gpus}x {torch.cuda.get_device_name(0)}",
                  torch=torch.__version__, commit=args.commit, date=datetime.date.today().isoformat())
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast on shared machines
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else [gpus]
    if any(w < 1 or (w > gpus and not args.cpu) for w in worlds):
        raise SystemExit(f"--worlds {args.worlds}: this machine has {gpus} GPUs")
    results = []
    for repeat in range(args.repeats):
        for config in args.configs.split(","):
            for world in worlds:
                results += [dict(r, **common) for r in run_config(config, world, args, repeat)]
    return results


def combine(args):
    """The rows of earlier invocations' logs, each run a repeat of its own, with the
    device, torch, commit and date its results.jsonl recorded."""
    configs, results = args.configs.split(","), []
    runs_so_far = collections.Counter()  # (config, world) -> repeats already read
    for folder in args.combine:
        recorded = [json.loads(line) for line in open(os.path.join(folder, "results.jsonl"))]
        for r in recorded:
            if r["system"] == "fsdp.cpp" and r["config"] in configs:
                repeat = runs_so_far[r["config"], r["world"]]
                runs_so_far[r["config"], r["world"]] += 1
                meta = {k: r[k] for k in ("device", "torch", "commit", "date")}
                results += [dict(x, **meta) for x in
                            collect(r["config"], r["world"], folder, args.steps, repeat, r.get("repeat", 0))]
    return results


def medians(results):
    """One row per (system, config, world): the median of each number over the repeats."""
    groups = collections.defaultdict(list)
    for r in results:
        groups[(r["system"], r["config"], r["world"])].append(r)
    out = {}
    for key, runs in groups.items():
        m = dict(runs[0], runs=runs)
        for field in ("step_ms", "tok_s_gpu", "mfu", "peak_alloc_gib", "peak_reserved_gib"):
            m[field] = statistics.median(r[field] for r in runs)
        out[key] = m
    return out


def write_markdown(results, worlds, path, common):
    repeated = any(r["repeat"] for r in results)
    lines = [f"# fsdp.cpp vs PyTorch: {common['device']}, torch {common['torch']}, "
             f"commit {common['commit'][:10]}, {common['date']}", "",
             "| system | config | GPUs | " + ("run | " if repeated else "") + "ms/step | tokens/s/GPU | MFU | "
             "peak alloc GiB | peak reserved GiB | reserved/alloc | exposed comm ms | GPU idle ms | AG waits | "
             "CPU ahead ms (groups) | loss first → last |",
             "|---|---|---|" + ("---|" if repeated else "") + "---|---|---|---|---|---|---|---|---|---|---|"]
    ms = lambda v: "" if v is None else f"{v:.1f}"
    ahead = lambda r: "" if r.get("cpu_lead_ms") is None else f"{r['cpu_lead_ms']:.1f} ({r['groups_ahead_max']})"
    for r in results:
        lines.append(
            f"| {r['system']} | {r['config']} | {r['world']} | " + (f"{r['repeat'] + 1} | " if repeated else "") +
            f"{r['step_ms']:.1f} | {r['tok_s_gpu']:,.0f} | {r['mfu']:.1%} | {r['peak_alloc_gib']:.2f} | "
            f"{r['peak_reserved_gib']:.2f} | {ratio(r['peak_reserved_gib'], r['peak_alloc_gib'])} | "
            f"{ms(r['exposed_comm_ms'])} | {ms(r['gpu_idle_ms'])} | {r['allgather_waits']} | "
            f"{ahead(r)} | {r['loss_first']:.4f} → {r['loss_last']:.4f} |")
    by_key = medians(results)
    lines += ["", "## Against the targets (same run, same GPUs" +
              ("; medians over the runs, the per-run speed ratios in brackets" if repeated else "") + ")", ""]
    for config, world, system in [(c, w, r) for c in CONFIGS for w in worlds for r in REFERENCES.get(c, [])]:
        if system not in PYTHON_FRONT_END:
            lines += comparison(by_key, config, world, "fsdp.cpp", system, repeated,
                                runtime_only=RUNTIME_ONLY.get(system))
    lines += float8_lines(by_key, worlds)
    python_lines = [line for c in CONFIGS for w in worlds for ours, theirs in PYTHON_PAIRS
                    for line in comparison(by_key, c, w, ours, theirs, repeated, name=ours)]
    if python_lines:
        lines += ["", "## The Python front end: the same script, fsdpcpp against FSDP2", ""] + python_lines
    if len(worlds) > 1:
        lines += scaling_markdown(by_key, worlds)
    open(path, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def comparison(by_key, config, world, ours_system, system, repeated, name=None, runtime_only=None):
    """The line comparing two systems' medians on one configuration (none if either did not run);
    with `runtime_only` (a Python front end system) that system's speed over `system` beside it."""
    ours, theirs = by_key.get((ours_system, config, world)), by_key.get((system, config, world))
    if not ours or not theirs:
        return []
    pairs = list(zip(ours["runs"], theirs["runs"]))
    gap = max(abs(a - b) for x, y in pairs for a, b in zip(x["losses"], y["losses"]))
    same_init = shares_init(CONFIGS[config][0]) and (ours_system in OWN_INIT_SYSTEMS) == (
        system in OWN_INIT_SYSTEMS)
    loss_note = (f"largest loss difference over {len(ours['losses'])} steps {gap:.4f}" if same_init
                 else "not compared (each system its own initial weights)")
    per_run = sorted(x["tok_s_gpu"] / y["tok_s_gpu"] for x, y in pairs)
    return [
        f"- {config} on {world} GPUs: {name + ' ' if name else ''}tokens/s/GPU "
        f"{ours['tok_s_gpu'] / theirs['tok_s_gpu']:.2f}x {system}" +
        (f" ({', '.join(f'{v:.2f}' for v in per_run)})" if repeated else "") +
        (f" (runtime only: {runtime_only} {twin['tok_s_gpu'] / theirs['tok_s_gpu']:.2f}x)"
         if (twin := by_key.get((runtime_only, config, world))) else "") + "; peak allocated "
        f"{ratio(ours['peak_alloc_gib'], theirs['peak_alloc_gib'])}x and reserved "
        f"{ratio(ours['peak_reserved_gib'], theirs['peak_reserved_gib'])}x its; reserved/allocated "
        f"{ratio(ours['peak_reserved_gib'], ours['peak_alloc_gib'])} "
        f"({system} {ratio(theirs['peak_reserved_gib'], theirs['peak_alloc_gib'])}); {loss_note}"]


def float8_lines(by_key, worlds):
    """Each "-fp8" config's systems over themselves on the config it adds float8 to."""
    lines = []
    for config in (c for c in CONFIGS if c.endswith("-fp8")):
        bf16 = config.removesuffix("-fp8")
        for world in worlds:
            for system in ["fsdp.cpp", *REFERENCES.get(config, [])]:
                fp8, base = by_key.get((system, config, world)), by_key.get((system, bf16, world))
                if fp8 and base:
                    lines.append(f"- {config} on {world} GPUs: {system} tokens/s/GPU "
                                 f"{fp8['tok_s_gpu'] / base['tok_s_gpu']:.2f}x its own {bf16}")
    return lines


def scaling_markdown(by_key, worlds):
    """Weak scaling (same batch per GPU): tokens/s/GPU and peak memory per GPU at each
    world size, efficiency against the smallest."""
    base = min(worlds)
    lines = ["", f"## Weak scaling (per-GPU batch fixed; efficiency = tokens/s/GPU vs {base} GPUs)", "",
             "| system | config | " + " | ".join(f"{w} GPUs: tok/s/GPU (eff), alloc/reserved GiB" for w in worlds) + " |",
             "|---|---|" + "---|" * len(worlds)]
    for system, config in dict.fromkeys((system, config) for system, config, _ in by_key):
        first = by_key.get((system, config, base))
        cells = []
        for w in worlds:
            r = by_key.get((system, config, w))
            cells.append("" if not r else
                         f"{r['tok_s_gpu']:,.0f} ({r['tok_s_gpu'] / first['tok_s_gpu']:.2f}), "
                         f"{r['peak_alloc_gib']:.2f}/{r['peak_reserved_gib']:.2f}" if first else "")
        lines.append(f"| {system} | {config} | " + " | ".join(cells) + " |")
    return lines


def profile_markdown(r):
    p = r["profile"]
    lines = [f"## {r['system']} {r['config']} (rank 0, median of {p['steps']} profiled steps)", "",
             f"step {p['step_ms']:.1f} ms: compute {p['compute_ms']:.1f}, NCCL {p['nccl_ms']:.1f}, "
             f"exposed communication {p['exposed_comm_ms']:.1f}, GPU idle {p['idle_ms']:.1f}, "
             f"{p['kernels']:.0f} kernels", ""]
    if p["kinds"]:  # none on CPU ranks
        lines += ["GPU time by kind of kernel (ms a step, summed): " +
                  ", ".join(f"{k} {ms:.1f}" for k, ms in p["kinds"].items()), ""]
    # The model's FLOPs a step (its matrix products and attention) over those kernels' time.
    gemm_ms = p["kinds"].get("matrix products", 0) + p["kinds"].get("attention", 0)
    if gemm_ms > 0 and r.get("flops_per_token"):
        flops = r["flops_per_token"] * r["tok_s_gpu"] * r["step_ms"] / 1e3
        lines += [f"Matrix products and attention at {flops / (gemm_ms / 1e3) / 1e12:.0f} TFLOP/s "
                  f"({flops / 1e12:.1f} TFLOP a step over their {gemm_ms:.1f} ms of kernels).", ""]
    lines += ["| ms/step | calls/step | kernel |", "|---|---|---|"]
    lines += [f"| {k['ms']:.2f} | {k['calls']:.0f} | `{k['name']}` |" for k in p["top_kernels"]]
    return "\n".join(lines) + "\n\n"


if __name__ == "__main__":
    sys.exit(main())
