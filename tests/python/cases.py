"""The Python front end's cases, each run on every rank under fsdp-run (test_fsdpcpp.py starts
them): python cases.py CASE [options]. A case asserts its outcome and exits 0, or raises.

Parity cases train a sharded model and a single-process reference from the same weights on the
same global batches, and compare losses and final parameters within the bounds of
tests/helpers.h (float32 rounding: eps = 2 * lambda * sqrt(D * K) * u per step; AdamW with
adam_eps = 1e-2 so that a rounding difference moves a parameter by a bounded amount)."""

import argparse
import copy
import json
import math
import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdpcpp  # noqa: E402
from models import MODELS, blocks_of, loss_of  # noqa: E402

UNIT_ROUNDOFF = 2.0 ** -24
LAMBDA = 10
ADAM_EPS = 1e-2
LR = 1e-2
ROWS, SEQ, VOCAB = 12, 16, 64  # the global batch: 12 rows divide among 1, 2, 3 and 4 ranks


def adam_ratio_bound(t, beta1=0.9, beta2=0.999):
    """R_t of tests/helpers.h: the largest |m_hat| / sqrt(v_hat) at step t (from 1)."""
    s = sum(((1 - beta1) * beta1 ** (t - i) / (1 - beta1 ** t)) ** 2 /
            ((1 - beta2) * beta2 ** (t - i) / (1 - beta2 ** t)) for i in range(1, t + 1))
    return math.sqrt(s)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)


def my_rows(tokens):
    rows = ROWS // fsdpcpp.world_size()
    return tokens[fsdpcpp.rank() * rows:(fsdpcpp.rank() + 1) * rows]


def build(name):
    torch.manual_seed(0)
    return MODELS[name]()


def shard(model, mp=None, reshard=True, checkpointed=False):
    kwargs = {"mp_policy": mp} if mp else {}
    for block in blocks_of(model):
        if checkpointed:
            wrap_checkpointed(block)
        fsdpcpp.fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fsdpcpp.fully_shard(model, **kwargs)
    return model


def wrap_checkpointed(block):
    """torch.utils.checkpoint (non-reentrant) around the block's forward, inside its hooks."""
    forward = block.forward
    block.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(forward, *a, use_reentrant=False, **k)


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1)


class Reference:
    """The single-process run: the whole global batch each step; records what bounds the
    sharded run (tests/helpers.h)."""

    def __init__(self, name, steps, clip=0.0, accum=1):
        self.model = build(name)
        opt = optimizer_for(self.model)
        dims = [p.shape[-1] for p in self.model.parameters()] + [ROWS * SEQ, VOCAB]
        layers = len(blocks_of(self.model))
        eps = 2 * LAMBDA * math.sqrt((10 * layers + 4) * max(dims)) * UNIT_ROUNDOFF
        self.losses, self.relative, self.param_bound = [], [], 0.0
        for step in range(steps):
            tokens = batch(step)
            loss = 0.0
            for micro in tokens.chunk(accum):
                micro_loss = loss_of(self.model, micro) / accum
                micro_loss.backward()
                loss += micro_loss.item()
            largest = max(p.grad.abs().max().item() for p in self.model.parameters() if p.grad is not None)
            if clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            step_eps = (step + 1) * eps
            self.losses.append(loss)
            self.relative.append(step_eps)
            delta = step_eps * largest * (2 if clip else 1)
            self.param_bound += LR * (1 + adam_ratio_bound(step + 1)) * delta / ADAM_EPS
        self.params = {n: p.detach().clone() for n, p in self.model.named_parameters()}


def train_sharded(model, steps, clip=0.0, accum=1, optimizer_before=True, first_step=0, optimizer=None):
    opt = optimizer if optimizer is not None else optimizer_for(model) if optimizer_before else None
    losses = []
    for step in range(first_step, first_step + steps):
        if opt is None:
            opt = optimizer_for(model)
        tokens = my_rows(batch(step))
        loss = torch.zeros(())
        micros = tokens.chunk(accum)
        for i, micro in enumerate(micros):
            if accum > 1:
                model.set_requires_gradient_sync(i == len(micros) - 1)
            micro_loss = loss_of(model, micro) / accum
            micro_loss.backward()
            loss += micro_loss.detach()
        if clip:
            fsdpcpp.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(fsdpcpp._C.all_reduce_sum(loss.reshape(1)).item() / fsdpcpp.world_size())
    return losses, opt


def check_parity(ref, losses, model, what):
    problems = []
    for t, (a, b) in enumerate(zip(losses, ref.losses)):
        if not abs(a - b) <= ref.relative[t] * abs(b):
            problems.append(f"step {t}: loss {a:.9g} vs reference {b:.9g}, over the bound {ref.relative[t] * abs(b):.3g}")
    full = fsdpcpp.get_model_state_dict(model)
    for name, expected in ref.params.items():
        difference = (full[name] - expected).abs().max().item()
        if not difference <= ref.param_bound:
            problems.append(f"parameter {name}: differs by {difference:.3g}, over the bound {ref.param_bound:.3g}")
    if problems:
        raise AssertionError(f"{what} on {fsdpcpp.world_size()} ranks:\n  " + "\n  ".join(problems))
    if fsdpcpp.rank() == 0:
        print(f"{what}: parity on {fsdpcpp.world_size()} ranks, losses {[round(x, 5) for x in losses]}, "
              f"parameter bound {ref.param_bound:.3g}")


def case_parity(args):
    steps = 4
    ref = Reference(args.model, steps, clip=args.clip, accum=args.accum)
    model = build(args.model)
    opt = optimizer_for(model) if args.optimizer_before else None
    shard(model, checkpointed=args.checkpointed, reshard=not args.keep_after_forward)
    losses, _ = train_sharded(model, steps, clip=args.clip, accum=args.accum, optimizer=opt,
                              optimizer_before=args.optimizer_before)
    check_parity(ref, losses, model, f"{args.model} (optimizer {'before' if args.optimizer_before else 'after'} "
                 f"sharding{', checkpointed blocks' if args.checkpointed else ''}{f', clip {args.clip}' if args.clip else ''}"
                 f"{f', {args.accum} micro-batches' if args.accum > 1 else ''})")


CASES = {"parity": case_parity}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--model", default="plain", choices=sorted(MODELS))
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--optimizer-before", action="store_true")
    parser.add_argument("--checkpointed", action="store_true")
    parser.add_argument("--keep-after-forward", action="store_true")
    parser.add_argument("--dir", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fsdpcpp.init()
    CASES[args.case](args)


if __name__ == "__main__":
    main()
