"""Models for the Python tests: a plain PyTorch Llama written as its users write it (F.rms_norm,
SDPA, fused QKV), a Llama laid out as torchtitan's (separate projections, nn.RMSNorm modules, RoPE)
with torchtitan's tensor-parallel plan, and transformers' own LlamaForCausalLM and GPT2LMHeadModel
from small configs."""

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads, ffn):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.Parameter(torch.ones(dim))
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(dim))
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = F.rms_norm(x, (d,), self.attn_norm)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(F.rms_norm(x, (d,), self.mlp_norm)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, vocab=64, dim=32, layers=2, heads=4, ffn=48):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.checkpoint_calls = False  # torch.utils.checkpoint around each block's call (hooks included)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.checkpoint_calls else layer(x)
        logits = self.head(F.rms_norm(x, (x.shape[-1],), self.norm))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def rope(x):
    """Rotary position embedding of x [batch, seq, heads, head_dim] (torchtitan's, by cos/sin)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32),
                        1.0 / 10000.0 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)


class TitanAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: this rank's share of them when tensor parallelism splits the projections.
        q = rope(self.wq(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = rope(self.wk(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(a.transpose(1, 2).reshape(b, s, -1))


class TitanFeedForward(nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = TitanAttention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = TitanFeedForward(dim, ffn)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLlama(nn.Module):
    def __init__(self, vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=48):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TitanBlock(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.loss_parallel = False  # the output head's logits split by vocabulary (tensor_parallel)

    def forward(self, tokens, targets):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def tensor_parallel(model, tp_mesh):
    """torchtitan's plan, sequence parallel: the embedding row-parallel into sequence shards, the
    norms sequence-parallel, attention and feed-forward column- then row-parallel, the output head
    column-parallel with the loss parallel. transformers' Llama: its config's base_model_tp_plan, applied
    by parallelize_module as the same ColwiseParallel / RowwiseParallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    if isinstance(model, TitanLlama):
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # Loss parallel, as torchtitan: the logits stay split by vocabulary (forward and backward
            # then run in torch's loss_parallel context: TitanLlama.loss_parallel).
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })
        model.loss_parallel = True
        for block in model.layers:
            parallelize_module(block, tp_mesh, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        return model
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name.replace("layers.*.", ""): styles[style]() for name, style in model.config.base_model_tp_plan.items()
            if style in styles}
    for block in model.model.layers:
        parallelize_module(block, tp_mesh, plan)
    return model


def plain_llama():
    return Llama()


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config)  # its output head is tied to the token embedding


MODELS = {"plain": plain_llama, "titan": TitanLlama, "llama": hf_llama, "gpt2": hf_gpt2}


def blocks_of(model):
    """The repeated blocks fully_shard takes one by one."""
    if isinstance(model, (Llama, TitanLlama)):
        return list(model.layers)
    if hasattr(model, "model"):  # LlamaForCausalLM
        return list(model.model.layers)
    return list(model.transformer.h)  # GPT2LMHeadModel


def checkpoint_calls(model):
    """Activation checkpointing of every block: for ours, around each block's call, its forward
    hooks included, as scripts calling checkpoint(layer, x) do (the recomputation runs
    fully_shard's hooks again, inside backward); transformers' gradient checkpointing wraps the
    layers' forward, inside the hooks."""
    if isinstance(model, Llama):
        model.checkpoint_calls = True
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def loss_parallel_of(model):
    """torch's loss_parallel context where the model's logits are split by vocabulary (forward and
    backward run in it), else none."""
    import contextlib
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel() if getattr(model, "loss_parallel", False) else contextlib.nullcontext()


def loss_of(model, tokens):
    """The mean next-token loss over the rows of `tokens` ([rows, seq + 1])."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if isinstance(model, (Llama, TitanLlama)) or isinstance(getattr(model, "_orig_mod", None), Llama):
        return model(inputs, targets)
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
