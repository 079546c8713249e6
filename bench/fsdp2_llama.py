"""PyTorch reference for the fsdp.cpp benchmark: the Llama written the way PyTorch users write
it, trained with FSDP2 (eager, or torch.compile on each block) or DDP.

The model: one fused QKV and one fused gate/up projection, F.rms_norm, rotary embeddings on
(i, i + d/2) pairs as transformers writes them (x * cos + rotate_half(x) * sin), causal
scaled_dot_product_attention, SwiGLU, no biases; logits then F.cross_entropy in float32. The
same synthetic batches as fsdp-train (trainer/train/data.cpp, same generator seeds), the same initial
weights (read from fsdp-train --save-init: the same parameter names; without --init, weights of
the same distribution made after sharding, as for the 8B), fused AdamW, warmup +
cosine schedule and clipping. Writes one JSON line per step in fsdp-train's format.

    torchrun --nproc-per-node 2 bench/fsdp2_llama.py --model 1b --init w.pt --jsonl out.jsonl
        [--compile]   torch.compile each block before fully_shard, and the loss (torchtitan's recipe)
        [--ddp]       DistributedDataParallel with bf16 autocast instead of FSDP2
        [--fsdp1]     FSDP1 (FullyShardedDataParallel, one unit a block, use_orig_params, its
                      MixedPrecision and clip_grad_norm_) instead of FSDP2; needs --init
        [--no-limit-all-gathers]   with --fsdp1: limit_all_gathers=False (FSDP1's rate limiter off)
        [--accelerate]  FSDP2 applied by accelerate's Accelerator.prepare(model, optimizer) (its
                      plugin's transformer wrap of each block, fsdp_version=2): with
                      --optimizer-before-shard, accelerate's fix (the optimizer's parameters
                      switched to the sharded ones); needs --init
        [--attention aten|flash]   flash: cuDNN attention off, so SDPA takes FlashAttention-2
                      (fsdp-train --attention flash); default ATen's choice (cuDNN on Hopper)
        [--fp8 tensorwise|rowwise]   float8 training on the blocks' linears (not the head), as
                      fsdp-train --fp8: torchao's under FSDP2, tensorwise with float8 all-gather and
                      precomputed scales (torchtitan's recipe; needs torchao); fsdpcpp.float8's
                      function of the same name under --runtime fsdpcpp (no scale precompute)
        [--runtime fsdpcpp]   the same script sharded by fsdp.cpp's Python package instead of FSDP2:
                      only the import of fully_shard, MixedPrecisionPolicy and CPUOffloadPolicy
                      changes, and fsdpcpp.init() joins (PYTHONPATH=build/py, or pip install .)
        [--hf]        transformers' own LlamaForCausalLM of the preset's shapes (SDPA) instead of
                      the model below, built on meta and initialised by its init_weights (the same
                      seed under either runtime); --recompute is transformers' gradient checkpointing
        [--tp N]      torch's tensor parallelism over N consecutive ranks with torchtitan's plan
                      (sequence parallel, loss parallel), then fully_shard over the "dp" dimension,
                      as torchtitan composes them; q, k, v and gate, up are then projections of
                      their own (as torchtitan writes them; --init's fused ones are split)
"""
import argparse
import contextlib
import json
import math
import os
import resource
import threading
import time

import torch
import torch.distributed as dist
import torch.jit._pickle
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, FullyShardedDataParallel, MixedPrecision,
                                    MixedPrecisionPolicy, fully_shard)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel

from presets import hf_presets

def _short(hf):
    """Hugging Face LlamaConfig fields in this script's short names (RoPE's as rope_theta and
    rope_scaling, or as transformers 5 writes them, rope_parameters)."""
    rope = hf.get("rope_parameters") or {}
    c = dict(vocab=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
             n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
             ffn=hf["intermediate_size"], theta=hf.get("rope_theta", rope.get("rope_theta")),
             tie=hf["tie_word_embeddings"])
    r = hf.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    if r:
        c["rope_scaling"] = dict(factor=r["factor"], low=r["low_freq_factor"], high=r["high_freq_factor"],
                                 original=r["original_max_position_embeddings"])
    return c


PRESETS = {name: _short(hf) for name, hf in hf_presets().items()}  # fsdp-train's (trainer/model/presets.json)


def model_config(model):
    """--model: one of fsdp-train's presets, or a folder with a Hugging Face config.json (the shapes
    of bench/llama_slice.py's slice, which fsdp-train reads by --init-from)."""
    if model in PRESETS:
        return PRESETS[model]
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise SystemExit(f"--model {model}: neither a preset ({', '.join(sorted(PRESETS))}) nor a folder with config.json")
    with open(path) as f:
        return _short(json.load(f))
EPS = 1e-5


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """q, k and v in one projection; or (split, for tensor parallelism, as torchtitan writes it) in
    three, whose outputs then hold this rank's heads."""
    def __init__(self, c, split=False):
        super().__init__()
        self.h, self.kv, self.d = c["n_heads"], c["n_kv_heads"], c["dim"] // c["n_heads"]
        self.split = split
        if split:
            self.wq = nn.Linear(c["dim"], self.h * self.d, bias=False)
            self.wk = nn.Linear(c["dim"], self.kv * self.d, bias=False)
            self.wv = nn.Linear(c["dim"], self.kv * self.d, bias=False)
        else:
            self.wqkv = nn.Linear(c["dim"], (self.h + 2 * self.kv) * self.d, bias=False)
        self.wo = nn.Linear(self.h * self.d, c["dim"], bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        if self.split:
            q, k, v = (w(x).view(b, t, -1, self.d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        else:
            q, k, v = self.wqkv(x).view(b, t, -1, self.d).transpose(1, 2).split([self.h, self.kv, self.kv], dim=1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    """gate and up in one projection, or (split) in two."""
    def __init__(self, c, split=False):
        super().__init__()
        self.split = split
        if split:
            self.w_gate = nn.Linear(c["dim"], c["ffn"], bias=False)
            self.w_up = nn.Linear(c["dim"], c["ffn"], bias=False)
        else:
            self.w_gate_up = nn.Linear(c["dim"], 2 * c["ffn"], bias=False)
        self.w_down = nn.Linear(c["ffn"], c["dim"], bias=False)

    def forward(self, x):
        gate, up = (self.w_gate(x), self.w_up(x)) if self.split else self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c, split=False):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(c["dim"], eps=EPS), Attention(c, split)
        self.mlp_norm, self.mlp = nn.RMSNorm(c["dim"], eps=EPS), Mlp(c, split)

    def forward(self, x, cos, sin):
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class Llama(nn.Module):
    def __init__(self, c, max_seq, checkpointed=(), split=False):
        super().__init__()
        self.checkpointed = set(checkpointed)  # indices of the blocks recomputed in backward
        self.tok_emb = nn.Embedding(c["vocab"], c["dim"])
        self.blocks = nn.ModuleList(Block(c, split) for _ in range(c["n_layers"]))
        self.norm = nn.RMSNorm(c["dim"], eps=EPS)
        self.head = nn.Linear(c["dim"], c["vocab"], bias=False)
        if c.get("tie"):
            self.head.weight = self.tok_emb.weight
        self.c, self.max_seq = c, max_seq
        self.register_buffer("rope_cos", torch.empty(max_seq, c["dim"] // c["n_heads"]), persistent=False)
        self.register_buffer("rope_sin", torch.empty_like(self.rope_cos), persistent=False)
        self.init_rope()

    @torch.no_grad()
    def init_rope(self):
        half = self.c["dim"] // self.c["n_heads"] // 2
        inv_freq = self.c["theta"] ** (-torch.arange(0, half, dtype=torch.float64) / half)
        if "rope_scaling" in self.c:  # Llama 3's: keep short wavelengths, divide long ones, blend between
            r = self.c["rope_scaling"]
            kept = ((r["original"] * inv_freq / (2 * math.pi) - r["low"]) / (r["high"] - r["low"])).clamp(0, 1)
            inv_freq = inv_freq * (kept + (1 - kept) / r["factor"])
        angles = torch.outer(torch.arange(self.max_seq, dtype=torch.float64), inv_freq).repeat(1, 2)  # [t, d]
        if self.rope_cos.device.type != "meta":
            self.rope_cos.copy_(angles.cos())
            self.rope_sin.copy_(angles.sin())

    @torch.no_grad()
    def init_weights(self):
        """fsdp-train's scheme (LlamaImpl::reset_parameters), in distribution, not value: normal
        std 0.02, output projections 0.02 / sqrt(2 layers), norms 1. Works on sharded parameters."""
        out_std = 0.02 / math.sqrt(2 * self.c["n_layers"])
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, out_std if ("wo." in name or "w_down." in name) else 0.02)
        self.init_rope()

    def forward(self, tokens):
        h = self.tok_emb(tokens)
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t].to(h.dtype), self.rope_sin[:t].to(h.dtype)
        for i, block in enumerate(self.blocks):
            if i in self.checkpointed:
                h = torch.utils.checkpoint.checkpoint(block, h, cos, sin, use_reentrant=False)
            else:
                h = block(h, cos, sin)
        return self.head(self.norm(h))


def split_projections(weights, c):
    """A state dict of the fused model (fsdp-train's names) for the split one: wqkv's rows as wq,
    wk and wv, w_gate_up's as w_gate and w_up."""
    d = c["dim"] // c["n_heads"]
    out = {}
    for name, w in weights.items():
        if name.endswith("attn.wqkv.weight"):
            base = name[:-len("wqkv.weight")]
            sizes = [c["n_heads"] * d, c["n_kv_heads"] * d, c["n_kv_heads"] * d]
            out.update(zip((base + "wq.weight", base + "wk.weight", base + "wv.weight"), w.split(sizes)))
        elif name.endswith("mlp.w_gate_up.weight"):
            base = name[:-len("w_gate_up.weight")]
            out.update(zip((base + "w_gate.weight", base + "w_up.weight"), w.chunk(2)))
        else:
            out[name] = w
    return out


def tensor_parallel(model, tp_mesh):
    """torchtitan's plan for its Llama (sequence parallel), on the split model: the embedding
    row-parallel into sequence shards, the norms sequence-parallel, attention and MLP column- then
    row-parallel, the head column-parallel into torch's loss_parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    parallelize_module(model, tp_mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=Shard(1)),
        })


def hf_llama(c, max_seq):
    """transformers' LlamaForCausalLM of preset `c`'s shapes, as its users configure it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    assert "rope_scaling" not in c, "--hf: presets with RoPE scaling (3b) are not mapped to transformers' config"
    config = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["dim"], intermediate_size=c["ffn"],
                         num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
                         num_key_value_heads=c["n_kv_heads"], rope_theta=c["theta"], rms_norm_eps=EPS,
                         max_position_embeddings=max_seq, tie_word_embeddings=c.get("tie", False),
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def mix(x):
    """trainer/train/data.cpp's mix (splitmix64's output function), in 64 bits."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def synthetic_rows(vocab, seed, first, rows, seq):
    """trainer/train/data.cpp's SyntheticTokens: samples [first, first + rows), row for row."""
    out = torch.empty(rows, seq + 1, dtype=torch.long)
    positions = torch.arange(seq + 1)
    for r in range(rows):
        g = torch.Generator().manual_seed(mix(seed) ^ (first + r))
        start = torch.randint(0, vocab, (1,), generator=g)
        stride = torch.randint(1, 5, (1,), generator=g)
        out[r] = (positions * stride + start) % vocab
    return out


class MemorySampler:
    """The format of fsdp-train --memory-log: samples every 10 ms, step markers."""

    def __init__(self, path, device):
        self.out, self.device, self.start = open(path, "w"), device, time.perf_counter()
        self.lock, self.stop = threading.Lock(), False
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def write(self, row):
        with self.lock:
            self.out.write(json.dumps(dict(t=time.perf_counter() - self.start, **row)) + "\n")

    def loop(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self.stop:
            gpu = self.device.type == "cuda"
            rss = int(open("/proc/self/statm").read().split()[1]) * page
            self.write(dict(alloc_gib=torch.cuda.memory_allocated(self.device) / 2**30 if gpu else 0.0,
                            reserved_gib=torch.cuda.memory_reserved(self.device) / 2**30 if gpu else 0.0,
                            rss_gib=rss / 2**30))
            time.sleep(0.01)

    def mark_step(self, step, loss):
        self.write(dict(step=step, loss=loss))

    def close(self):
        self.stop = True
        self.thread.join()
        self.out.close()


def lr_at(step, lr, min_lr, warmup, total):
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1b")
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--recompute", action="store_true", help="recompute every block in backward")
    p.add_argument("--recompute-blocks", default="",
                   help="comma-separated indices of the blocks to recompute in backward (selective "
                        "checkpointing, e.g. the blocks fsdp-train --plan-check's plans name)")
    p.add_argument("--init", help="weights written by fsdp-train --save-init (default: made on the meta "
                                  "device, sharded, then initialised like fsdp-train's, not to the same values)")
    p.add_argument("--jsonl", required=True, help="per-step log (JSON lines)")
    p.add_argument("--memory-log", help="sample memory into PATH-rankR.jsonl (fsdp-train's format)")
    p.add_argument("--optimizer-before-shard", action="store_true",
                   help="create AdamW before fully_shard, without any fix (the FSDP2 pitfall)")
    p.add_argument("--profile", help="profiler trace of the last --profile-steps steps to PATH-rankR.json")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--memory-snapshot", help="rank 0's CUDA allocator history over the last --profile-steps steps, "
                                             "with Python stacks, to PATH (bench/snapshot_holes.py reads it)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block before fully_shard")
    p.add_argument("--ddp", action="store_true", help="DDP with bf16 autocast instead of FSDP2")
    p.add_argument("--fsdp1", action="store_true", help="FSDP1 (FullyShardedDataParallel) instead of FSDP2")
    p.add_argument("--accelerate", action="store_true",
                   help="FSDP2 through accelerate's Accelerator.prepare(model, optimizer)")
    p.add_argument("--no-limit-all-gathers", action="store_true",
                   help="with --fsdp1: limit_all_gathers=False (the CPU may issue every all-gather ahead)")
    p.add_argument("--fp8", choices=["tensorwise", "rowwise"],
                   help="float8 linears in the blocks, torchao's or fsdpcpp.float8's (tensorwise: float8 all-gather)")
    p.add_argument("--attention", choices=["aten", "flash"], default="aten",
                   help="SDPA kernel: ATen's choice or flash")
    p.add_argument("--cpu-offload", action="store_true",
                   help="CPUOffloadPolicy: sharded parameters, gradients and AdamW on the host")
    p.add_argument("--runtime", choices=["fsdp2", "fsdpcpp"], default="fsdp2",
                   help="who shards the model: PyTorch's FSDP2 or fsdp.cpp's Python package (fsdpcpp)")
    p.add_argument("--hf", action="store_true", help="transformers' LlamaForCausalLM of the preset's shapes")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism over this many consecutive ranks (torchtitan's plan on q, k, v and "
                        "gate, up as projections of their own), fully_shard over the rest; --batch is then per tp "
                        "group")
    p.add_argument("--memory-budget", type=float, default=0.0,
                   help="GiB a GPU may hold: fsdpcpp.plan_memory_budget picks recomputation and prefetch (fsdpcpp only)")
    args = p.parse_args()
    global fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy
    if args.runtime == "fsdpcpp":  # the migration: these names from fsdpcpp instead of torch.distributed.fsdp
        import fsdpcpp
        from fsdpcpp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        assert not (args.ddp or args.fsdp1), "--ddp and --fsdp1 are other runtimes than fsdpcpp"
    assert not args.no_limit_all_gathers or args.fsdp1, "--no-limit-all-gathers is FSDP1's: add --fsdp1"
    assert not args.fsdp1 or (args.init and not (args.ddp or args.compile or args.fp8 or args.cpu_offload)), \
        "--fsdp1: from --init weights, eager, bf16, no offload"
    assert not args.accelerate or (args.init and args.runtime == "fsdp2" and not (
        args.ddp or args.fsdp1 or args.compile or args.fp8 or args.cpu_offload)), \
        "--accelerate: FSDP2 (eager, bf16, no offload) from --init weights"
    assert not args.memory_budget or args.runtime == "fsdpcpp", "--memory-budget plans fsdpcpp's schedule: add --runtime fsdpcpp"
    assert not args.memory_budget or args.steps > 5, "--memory-budget: the planner's five steps come first; pass --steps 6 or more"
    assert args.tp == 1 or not (args.hf or args.ddp or args.fsdp1 or args.accelerate or args.fp8 or
                                args.cpu_offload or args.memory_budget or args.optimizer_before_shard), \
        "--tp: the script's own model, FSDP2 or fsdpcpp in bf16, no offload or planner"

    on_gpu = torch.cuda.is_available()  # CPU (gloo) only to check the script itself
    assert on_gpu or not args.memory_snapshot, "--memory-snapshot records the CUDA allocator: run on a GPU"
    for name, ompi in (("RANK", "OMPI_COMM_WORLD_RANK"), ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
                       ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")):  # under mpirun rather than torchrun
        if ompi in os.environ:
            os.environ.setdefault(name, os.environ[ompi])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    # Offloaded gradients are CPU tensors: clip_grad_norm_'s all-reduce of them needs gloo.
    dist.init_process_group("cuda:nccl,cpu:gloo" if on_gpu and args.cpu_offload else "nccl" if on_gpu else "gloo")
    if args.cpu_offload:  # torchrun sets OMP_NUM_THREADS=1; the host optimizer gets this rank's share, as fsdp-train's
        torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if args.runtime == "fsdpcpp":
        fsdpcpp.init()  # beside the process group: fsdp.cpp makes its own communicator
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    c = model_config(args.model)
    checkpointed = (range(c["n_layers"]) if args.recompute else
                    [int(i) for i in args.recompute_blocks.split(",") if i.strip()])
    if args.attention == "flash":
        torch.backends.cuda.enable_cudnn_sdp(False)  # SDPA's next choice on Hopper is flash

    if args.hf:
        assert not (args.init or args.fp8 or args.recompute_blocks or args.ddp or args.optimizer_before_shard), \
            "--hf: its own initial weights, all or no blocks recomputed, FSDP only"
        torch.manual_seed(args.seed)
        with torch.device("meta"):
            model = hf_llama(c, max(args.seq, 2048))
        if args.recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif args.init:
        model = Llama(c, max(args.seq, 2048), checkpointed, split=args.tp > 1)
        with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
            weights = torch.load(args.init)
        if args.tp > 1:  # fsdp-train's fused projections, as the split model's own
            weights = split_projections(weights, c)
        missing = model.load_state_dict(weights, strict=False)
        assert not missing.missing_keys and not missing.unexpected_keys, missing
        model.to(device)
    else:  # FSDP2's recipe for models too large for one process: shapes now, memory after sharding
        assert not args.ddp and not args.optimizer_before_shard, "--ddp and --optimizer-before-shard need --init"
        torch.manual_seed(args.seed)
        with torch.device("meta"):
            model = Llama(c, max(args.seq, 2048), checkpointed, split=args.tp > 1)
    shard_mesh = None  # fully_shard's default: every rank
    if args.tp > 1:  # torchtitan's order: tensor parallelism, then compile, then fully_shard over dp
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        shard_mesh = mesh["dp"]

    def make_optimizer():
        # fused=True: the kernel fsdp-train's FusedAdamW calls (CUDA and CPU).
        return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                 weight_decay=args.weight_decay, fused=True)

    precompute_float8_scales = None
    if args.fp8:  # torchtitan's order: float8 conversion, then compile, then sharding
        in_blocks = lambda module, fqn: fqn.startswith("blocks.")
        if args.runtime == "fsdpcpp":  # the migration: fsdpcpp.float8's function of torchao's name
            from fsdpcpp.float8 import convert_to_float8_training
            convert_to_float8_training(model, recipe=args.fp8, module_filter_fn=in_blocks)  # float8 all-gather: tensorwise
        else:
            from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                        precompute_float8_dynamic_scale_for_fsdp)
            config = (Float8LinearConfig(enable_fsdp_float8_all_gather=True) if args.fp8 == "tensorwise"
                      else Float8LinearConfig.from_recipe_name("rowwise"))
            convert_to_float8_training(model, config=config, module_filter_fn=in_blocks)
            if args.fp8 == "tensorwise":  # one all-reduce of every weight's amax for the next all-gathers
                precompute_float8_scales = precompute_float8_dynamic_scale_for_fsdp
    blocks = model.model.layers if args.hf else model.blocks
    if args.compile:  # after loading (the wrapper renames parameters), before sharding
        # Each block is its own frame to dynamo: past recompile_limit (8 by default) FSDP2's later
        # blocks would silently run eager. Raised for every block, and a hit fails the run.
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block)

    def cross_entropy(logits, targets):
        return F.cross_entropy(logits.reshape(-1, c["vocab"]).float(), targets.reshape(-1))

    # torchtitan compiles its loss with the blocks: the fp32 upcast and the softmax in one kernel
    # (not the loss parallel of its tensor-parallel runs, which runs on DTensors).
    loss_of = torch.compile(cross_entropy) if args.compile and args.tp == 1 else cross_entropy
    if args.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel
    else:
        loss_parallel = contextlib.nullcontext
    opt = make_optimizer() if args.optimizer_before_shard else None
    if args.ddp:
        model = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    elif args.accelerate:  # as accelerate's users shard: its plugin wraps, prepare() shards and fixes the optimizer
        from accelerate import Accelerator, FullyShardedDataParallelPlugin
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
            reshard_after_forward=True, cpu_ram_efficient_loading=False,
            mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        accelerator = Accelerator(fsdp_plugin=plugin)
        if opt:
            model, opt = accelerator.prepare(model, opt)
        else:
            model = accelerator.prepare(model)
        assert isinstance(model, FSDPModule), \
            "--accelerate: accelerate returned the model unsharded (it shards with FSDP on GPUs only)"
    elif args.fsdp1:  # as FSDP1's users wrap a transformer: one unit a block, the rest in the root
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            device_id=device, limit_all_gathers=not args.no_limit_all_gathers)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=on_gpu) if args.cpu_offload else None
        for block in blocks:
            fully_shard(block, mesh=shard_mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=shard_mesh, mp_policy=mp, offload_policy=offload)
        if not args.init:
            model.to_empty(device="cpu" if args.cpu_offload else device)  # offloaded shards live on the host
            model.init_weights()
        if args.cpu_offload:  # buffers are not offloaded: the forward reads them on the device
            for name, buffer in model.named_buffers():
                owner, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(owner), attribute, buffer.to(device))
    opt = opt or make_optimizer()
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    log = open(args.jsonl, "w") if rank == 0 else None
    sampler = MemorySampler(f"{args.memory_log}-rank{rank}.jsonl", device) if args.memory_log else None
    profiler = None
    step = 0
    first_profiled = max(0, args.steps - args.profile_steps)  # the profile's and the snapshot's first step

    def train_step():
        nonlocal profiler, step
        if args.memory_snapshot and rank == 0 and step == first_profiled:
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
        if args.profile and step == first_profiled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if on_gpu:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.start()
        with torch.profiler.record_function(f"ProfilerStep#{step + 1}"):  # the step's span in a profile
            start = time.perf_counter()
            lr = lr_at(step, args.lr, args.min_lr, args.warmup, args.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            data_ranks = world // args.tp  # fsdp-train's step s reads samples from s x the global batch
            tokens = synthetic_rows(c["vocab"], args.seed, (step * data_ranks + rank // args.tp) * args.batch,
                                    args.batch, args.seq).to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, torch.bfloat16, enabled=args.ddp):
                logits = model(input_ids=tokens[:, :-1]).logits if args.hf else model(tokens[:, :-1])
            with loss_parallel():
                loss = loss_of(logits, tokens[:, 1:])
                loss.backward()
            # With the optimizer made before sharding its parameters are the
            # replaced full tensors: clip what the model holds.
            if args.fsdp1:  # torch's would see only this rank's shards
                grad_norm = model.clip_grad_norm_(args.clip)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                grad_norm = grad_norm if args.ddp else grad_norm.full_tensor()
            opt.step()
            if precompute_float8_scales:
                precompute_float8_scales(model)
            global_loss = (loss.full_tensor() if args.tp > 1 else loss).detach().clone()  # tp: a replicated DTensor
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
            loss_value = global_loss.item()
            if sampler:
                sampler.mark_step(step + 1, loss_value)
            ms = (time.perf_counter() - start) * 1000
        alloc = torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else 0.0
        reserved = torch.cuda.max_memory_reserved(device) / 2**30 if on_gpu else 0.0
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        step += 1
        if log:
            row = dict(step=step, loss=loss_value, lr=lr, grad_norm=float(grad_norm),
                       step_ms=ms, tok_s=args.batch * args.seq * world // args.tp / (ms / 1000), tp=args.tp,
                       peak_alloc_gib=alloc, peak_reserved_gib=reserved, world=world,
                       model=args.model, compiled_loss=args.compile,
                       host_peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"{args.runtime} step {step:3d} | loss {loss_value:.4f} | {ms:7.1f} ms | "
                  f"peak alloc/reserved {alloc:.2f}/{reserved:.2f} GiB", flush=True)

    if args.memory_budget:  # its five steps are training steps, logged like the others; it prints the plan
        fsdpcpp.plan_memory_budget(model, train_step, int(args.memory_budget * 2**30))
    while step < args.steps:
        train_step()
    if profiler:
        profiler.stop()
        profiler.export_chrome_trace(f"{args.profile}-rank{rank}.json")
    if sampler:
        sampler.close()
    if args.memory_snapshot and rank == 0:
        torch.cuda.memory._dump_snapshot(args.memory_snapshot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
