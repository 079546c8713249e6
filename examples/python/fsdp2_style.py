"""An FSDP2 training script written the way PyTorch's FSDP2 example and torchtitan write theirs,
which runs on fsdpcpp with only the import changed (--runtime picks which import).

    PYTHONPATH=build/py build/fsdp-run -n 2 build/python examples/python/fsdp2_style.py --steps 4

What it does, all through torch's own calls: builds transformers' Llama on the meta device, shards
each decoder layer and the root over a DeviceMesh (1-D, or HSDP's 2-D with --replicas), allocates
and initialises the shards (to_empty, init_weights), trains with mixed precision on GPUs, torch's
clip_grad_norm_, and checkpoints with torch.distributed.checkpoint (get_state_dict /
set_state_dict), which either runtime resumes. --compile compiles each layer, as torchtitan does.
"""
import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--runtime", choices=["fsdpcpp", "fsdp2"], default="fsdpcpp")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--replicas", type=int, default=1, help="HSDP: a (replicas, world / replicas) mesh")
parser.add_argument("--compile", action="store_true", help="torch.compile each layer before sharding")
parser.add_argument("--save", help="a DCP checkpoint into this directory after step --save-at")
parser.add_argument("--save-at", type=int, default=0)
parser.add_argument("--resume", help="continue from a DCP checkpoint (written by either runtime)")
parser.add_argument("--jsonl", help="rank 0 writes each step's loss and gradient norm here (JSON lines)")
args = parser.parse_args()

if args.runtime == "fsdpcpp":
    from fsdpcpp import MixedPrecisionPolicy, fully_shard
else:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# torchrun sets these; under mpirun (fsdp-run) they come from Open MPI's.
for name, ompi in (("RANK", "OMPI_COMM_WORLD_RANK"), ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
                   ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")):
    os.environ.setdefault(name, os.environ.get(ompi, "0"))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
on_gpu = torch.cuda.is_available()
if on_gpu:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
shape = (world,) if args.replicas == 1 else (args.replicas, world // args.replicas)
mesh = init_device_mesh(device.type, shape, mesh_dim_names=("shard",) if len(shape) == 1 else ("replicate", "shard"))

config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_gpu else None, reduce_dtype=torch.float32)
for layer in model.model.layers:
    if args.compile:
        layer.compile()
    fully_shard(layer, mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)
model.to_empty(device=device)
torch.manual_seed(0)
model.init_weights()  # each rank its rows (DTensor's random-number tracker on GPUs), and the rotary buffers
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=on_gpu)

first = 0
if args.resume:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.zeros((), dtype=torch.long)}
    dcp.load(state, checkpoint_id=args.resume)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    first = int(state["step"])

log = open(args.jsonl, "a") if args.jsonl and rank == 0 else None
for step in range(first, args.steps):
    # Learnable rows: each repeats a random pattern of 8 tokens, this rank's own.
    pattern = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(step * world + rank))
    tokens = pattern.repeat(1, 9)[:, :65].to(device)
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
    optimizer.step()
    optimizer.zero_grad()
    loss = loss.detach()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    if rank == 0:
        print(f"step {step + 1:3d} | loss {loss.item():.4f} | grad norm {norm.item():.3f}", flush=True)
        if log:
            log.write(json.dumps({"step": step + 1, "loss": loss.item(), "grad_norm": norm.item()}) + "\n")
    if args.save and step + 1 == args.save_at:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(step + 1)},
                 checkpoint_id=args.save)
# The process groups go while the interpreter is alive: with nothing else holding them (the model's
# DTensors and the optimizer's state hold the mesh), destroy_process_group joins Gloo's worker
# threads. One left to the interpreter's exit can drop a Python tensor there and abort the process
# (torch issue #190489).
del model, optimizer, mesh
gc.collect()
dist.destroy_process_group()
