"""A transformers Llama trained with fsdpcpp, the drop-in for FSDP2's fully_shard.

    PYTHONPATH=build/py build/fsdp-run -n 2 build/python examples/python/train_llama.py

Two CPU ranks on a machine without GPUs, every local GPU otherwise (fsdp-run). The only fsdp.cpp
lines are the import, init(), the fully_shard calls and clip_grad_norm_; the rest is the script
an FSDP2 user already has.
"""
import argparse

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import fsdpcpp
from fsdpcpp import MixedPrecisionPolicy, fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--save", help="save_pretrained the trained model into this directory")
args = parser.parse_args()

fsdpcpp.init()  # mpirun's or torchrun's variables (fsdp-run sets them)
device, rank, world = fsdpcpp.device(), fsdpcpp.rank(), fsdpcpp.world_size()
torch.manual_seed(0)  # the same initial weights on every rank
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
model = LlamaForCausalLM(config).to(device)

on_gpu = device.type == "cuda"
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_gpu else None, reduce_dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer, mp_policy=mp)  # each decoder layer: one all-gather, one reduce-scatter
fully_shard(model, mp_policy=mp)  # the root last: embeddings, final norm, output head
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

for step in range(args.steps):
    # Learnable sequences: each row counts up by a random stride from a random start.
    g = torch.Generator().manual_seed(step * world + rank)
    start = torch.randint(0, 256, (8, 1), generator=g)
    stride = torch.randint(1, 5, (8, 1), generator=g)
    tokens = ((start + stride * torch.arange(65)) % 256).to(device)
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    norm = fsdpcpp.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
        print(f"step {step + 1:3d} | loss {loss.item():.4f} (rank 0's rows) | grad norm {norm.item():.3f}", flush=True)

state = fsdpcpp.get_model_state_dict(model)  # full weights on every rank, by transformers' names
if args.save and rank == 0:
    model.save_pretrained(args.save, state_dict=state)
    print(f"saved {args.save}")
