"""What the Python front end's cases share: the global batches, the models built from one seed,
the single-process reference and the parity bounds it records, the sharded and torch-style
training loops, the FSDP2-or-fsdpcpp choice.

Parity cases train a sharded model and a single-process reference from the same weights on the
same global batches, and compare losses and final parameters within the bounds of
tests/lib/helpers.h (float32 rounding: eps = 2 * lambda * sqrt(D * K) * u per step; AdamW with
adam_eps = 1e-2 so that a rounding difference moves a parameter by a bounded amount)."""

import math

import torch
import torch.utils.checkpoint

import fsdpcpp
from models import MODELS, blocks_of, loss_of, loss_parallel_of


UNIT_ROUNDOFF = 2.0 ** -24
LAMBDA = 10
ADAM_EPS = 1e-2
LR = 1e-2
ROWS, SEQ, VOCAB = 12, 16, 64  # the global batch: 12 rows divide among 1, 2, 3 and 4 ranks


def adam_ratio_bound(t, beta1=0.9, beta2=0.999):
    """R_t of tests/lib/helpers.h: the largest |m_hat| / sqrt(v_hat) at step t (from 1)."""
    s = sum(((1 - beta1) * beta1 ** (t - i) / (1 - beta1 ** t)) ** 2 /
            ((1 - beta2) * beta2 ** (t - i) / (1 - beta2 ** t)) for i in range(1, t + 1))
    return math.sqrt(s)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g).to(fsdpcpp.device())


def my_rows(tokens, tp=1):
    """This rank's rows of a global batch: the ranks of one tensor-parallel group (tp consecutive
    ranks) take the same rows."""
    rows, dp_rank = ROWS // (fsdpcpp.world_size() // tp), fsdpcpp.rank() // tp
    return tokens[dp_rank * rows:(dp_rank + 1) * rows]


def build(name):
    torch.manual_seed(0)
    return MODELS[name]().to(fsdpcpp.device())


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


def optimizer_for(model_or_params, lr_scale=1.0):
    """The tests' AdamW over a model's parameters, or over the parameters given."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    return torch.optim.AdamW(params, lr=LR * lr_scale, eps=ADAM_EPS, weight_decay=0.1)


class Reference:
    """The single-process run: the whole global batch each step; records what bounds the
    sharded run (tests/lib/helpers.h)."""

    def __init__(self, name, steps, clip=0.0, accum=1, prepare=None, before_step=None):
        """prepare(model): what a case changes in its model before the optimizer is made;
        before_step(model, step): before each step."""
        self.model = build(name)
        if prepare:
            prepare(self.model)
        opt = optimizer_for(self.model)
        dims = [p.shape[-1] for p in self.model.parameters()] + [ROWS * SEQ, VOCAB]
        layers = len(blocks_of(self.model))
        eps = 2 * LAMBDA * math.sqrt((10 * layers + 4) * max(dims)) * UNIT_ROUNDOFF
        self.losses, self.relative, self.norms, self.param_bound = [], [], [], 0.0
        for step in range(steps):
            if before_step:
                before_step(self.model, step)
            tokens = batch(step)
            loss = 0.0
            for micro in tokens.chunk(accum):
                micro_loss = loss_of(self.model, micro) / accum
                micro_loss.backward()
                loss += micro_loss.item()
            largest = max(p.grad.abs().max().item() for p in self.model.parameters() if p.grad is not None)
            if clip:
                self.norms.append(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
            step_eps = (step + 1) * eps
            self.losses.append(loss)
            self.relative.append(step_eps)
            delta = step_eps * largest * (2 if clip else 1)
            self.param_bound += LR * (1 + adam_ratio_bound(step + 1)) * delta / ADAM_EPS
        self.params = {n: p.detach().cpu() for n, p in self.model.named_parameters()}


def sharded_step(model, opt, step, clip=0.0, accum=1):
    """One training step of the sharded model on this rank's rows of global batch `step`; returns
    the global loss."""
    tokens = my_rows(batch(step))
    loss = torch.zeros((), device=fsdpcpp.device())
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
    fsdpcpp.all_reduce(loss)
    return loss.item() / fsdpcpp.world_size()


def train_sharded(model, steps, clip=0.0, accum=1, optimizer_before=True, first_step=0, optimizer=None):
    opt = optimizer if optimizer is not None else optimizer_for(model) if optimizer_before else None
    losses = []
    for step in range(first_step, first_step + steps):
        if opt is None:
            opt = optimizer_for(model)
        losses.append(sharded_step(model, opt, step, clip, accum))
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


def fully_shard_of(runtime, replicas=1, tp=1):
    """FSDP2's fully_shard or fsdpcpp's, the mesh torchtitan passes to it (1-D, or HSDP's
    (replicate, shard) for replicas > 1; with tp > 1 the dp dims of a (..., "tp") mesh) and the tp
    mesh (None for tp = 1), over a process group made as fsdpcpp makes it."""
    from torch.distributed.device_mesh import init_device_mesh
    from fsdpcpp._dtensor import _ensure_process_group
    _ensure_process_group()
    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fsdpcpp.fully_shard
    world, kind = fsdpcpp.world_size(), fsdpcpp.device().type
    shards = world // replicas // tp
    if tp > 1:
        dp = ("dp",) if replicas == 1 else ("dp_replicate", "dp_shard")
        shape = (shards,) if replicas == 1 else (replicas, shards)
        mesh = init_device_mesh(kind, (*shape, tp), mesh_dim_names=(*dp, "tp"))
        return fully_shard, mesh[dp], mesh["tp"]
    if replicas == 1:
        return fully_shard, init_device_mesh(kind, (world,)), None
    return fully_shard, init_device_mesh(kind, (replicas, shards), mesh_dim_names=("replicate", "shard")), None


def clip_over_meshes(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ where the parameters' DTensors span meshes (a model tensor
    parallelism splits only in part: its other parameters are on the dp mesh), which torch's
    refuses: the norm of each mesh's gradients made whole, then one clip."""
    from torch.distributed.tensor import DTensor
    by_mesh = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def torch_loop(model, opt, steps, clip, first=0, before_step=None, tp=1):
    """Steps first..steps-1 as FSDP2's users write them: torch's clip_grad_norm_, the optimizer,
    zero_grad. before_step(step) may return a new (model, opt). Returns the global losses and the
    gradient norms."""
    from torch.distributed.tensor import DTensor
    losses, norms = [], []
    for step in range(first, steps):
        if before_step:
            model, opt = before_step(step) or (model, opt)
        with loss_parallel_of(model):
            loss = loss_of(model, my_rows(batch(step), tp))
            loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
        clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ if len(meshes) < 2 else clip_over_meshes
        norm = clip_grad_norm_(model.parameters(), clip)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        fsdpcpp.all_reduce(loss, op="avg")
        losses.append(loss.item())
    return model, losses, norms


def check_torch_loop(what, ref, model, losses, norms, first=0):
    """Losses, gradient norms and torch's full get_model_state_dict (on every rank) within the
    parity bounds of the single-process reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    problems = []
    for t, (a, b, n, m) in enumerate(zip(losses, ref.losses[first:], norms, ref.norms[first:])):
        bound = ref.relative[first + t]
        if not (abs(a - b) <= bound * abs(b) and abs(n - m) <= bound * abs(m)):
            problems.append(f"step {first + t}: loss {a:.9g} vs {b:.9g}, gradient norm {n:.9g} vs {m:.9g}")
    for name, expected in ref.params.items():
        difference = (full[name].cpu() - expected).abs().max().item()
        if not difference <= ref.param_bound:
            problems.append(f"parameter {name} differs by {difference:.3g}, over the bound {ref.param_bound:.3g}")
    assert not problems, f"{what} on {fsdpcpp.world_size()} ranks:\n  " + "\n  ".join(problems)
    if fsdpcpp.rank() == 0:
        print(f"{what} on {fsdpcpp.world_size()} ranks: at parity, norms {norms}")


def expect_error(kind, text, call):
    try:
        call()
    except kind as e:
        assert text in str(e), f"the message does not say {text!r}: {e}"
        assert "\n" not in str(e).strip(), f"not one line: {e}"
        return str(e)
    raise AssertionError(f"no {kind.__name__} saying {text!r}")
