"""Sharded checkpoints: each rank writes its rows; loading works on any number of ranks
(fsdp/sharded_checkpoint.h's format, the one fsdp-train writes)."""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from torch.distributed.tensor import DTensor

from . import _C
from ._dtensor import managed, refuse_tp_parts, take_replacements_in
from ._runtime import rank

newest_checkpoint = _C.newest_checkpoint
checkpoint_name = _C.checkpoint_name
# How a checkpoint names what is not a parameter (the format's: fsdp/sharded_checkpoint.h):
# "buffer/NAME", "optimizer/PARAMETER/KEY".
BUFFER_PREFIX = _C.BUFFER_PREFIX
OPTIMIZER_PREFIX = _C.OPTIMIZER_PREFIX


def _initialise_optimizer_state(optimizer: torch.optim.Optimizer) -> dict | None:
    """An optimizer that has not stepped has no state to load into: one step with zero gradients
    and a learning rate of 0 makes it (no parameter changes; weight decay is scaled by the rate).
    Returns what to restore if the load then fails (None: nothing was made)."""
    if all(p in optimizer.state for group in optimizer.param_groups for p in group["params"]):
        return None
    before = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
              for p, state in optimizer.state.items()}
    saved_grads, saved_lrs = {}, []
    for group in optimizer.param_groups:
        saved_lrs.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            saved_grads[p] = p.grad
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = saved_grads[p]
    return before


def _restore_optimizer_state(optimizer: torch.optim.Optimizer, before: dict) -> None:
    optimizer.state.clear()
    optimizer.state.update(before)


def _entries(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    take_replacements_in(model, "fsdpcpp checkpoint")
    sharded, replicated = [], []
    names = {}
    for name, face in model.named_parameters():
        p = managed(face)
        if not _C.is_sharded_parameter(p):
            raise ValueError(f"fsdpcpp checkpoint: parameter '{name}' is not sharded: apply fully_shard to the root "
                             "module too")
        refuse_tp_parts([(name, p)], "fsdpcpp checkpoint", "torch.distributed.checkpoint (DCP) with get_state_dict")
        sharded.append((name, p.data, p))
        names[p] = names[face] = name  # an optimizer holds either (made before fully_shard: the managed one)
    persistent = set(model.state_dict(keep_vars=True))  # non-persistent buffers are rebuilt, not saved
    for name, b in model.named_buffers():
        if name in persistent:
            replicated.append((BUFFER_PREFIX + name, b.data))
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p not in names:
                    raise ValueError("fsdpcpp checkpoint: the optimizer holds a parameter the model does not")
                for key, value in optimizer.state[p].items():
                    entry = f"{OPTIMIZER_PREFIX}{names[p]}/{key}"
                    if isinstance(value, DTensor):  # the state of a face: its local rows are the managed shape
                        value = value._local_tensor
                    if isinstance(value, torch.Tensor) and value.shape == managed(p).shape and value.dim() > 0:
                        sharded.append((entry, value, managed(p)))
                    elif isinstance(value, torch.Tensor):
                        replicated.append((entry, value))
                    else:
                        raise ValueError(f"fsdpcpp checkpoint: optimizer state '{entry}' is a {type(value).__name__}, "
                                         "not a tensor")
    return sharded, replicated


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, str] | None = None) -> None:
    """Saves the sharded model (and optimizer state) to the directory `path`: each rank writes its
    rows, rank 0 the metadata; written to `path`.tmp and renamed once complete, replacing an
    existing `path`. `extra`: your own entries (step, data position), strings. Collective."""
    sharded, replicated = _entries(model, optimizer)
    _C.save_checkpoint(os.fspath(path), sharded, replicated, {str(k): str(v) for k, v in (extra or {}).items()})


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, str]:
    """Fills the sharded model (and optimizer state) in place from a checkpoint saved on any
    number of ranks; returns its `extra` entries. Without `optimizer`, the weights load alone and
    a checkpoint's optimizer state is left out (as torch's and DCP's loaders do), named in a
    warning on rank 0. Raises on every rank, naming the file and the problem, when the checkpoint
    does not fit (another model, missing or damaged files); the model and the optimizer are then
    exactly as they were (everything is checked before anything is copied). Collective."""
    before = _initialise_optimizer_state(optimizer) if optimizer is not None else None
    try:
        sharded, replicated = _entries(model, optimizer)
        extra, left_out = _C.load_checkpoint(os.fspath(path), sharded, replicated,
                                             OPTIMIZER_PREFIX if optimizer is None else "")
    except BaseException:
        if before is not None:
            _restore_optimizer_state(optimizer, before)
        raise
    if left_out and rank() == 0:
        owners = sorted({name[len(OPTIMIZER_PREFIX):].rsplit("/", 1)[0] for name in left_out})
        warnings.warn(f"fsdpcpp.load_checkpoint: loaded the model alone; left out the checkpoint's optimizer state "
                      f"({len(left_out)} tensors, of {len(owners)} parameters such as '{owners[0]}'): pass "
                      "optimizer= to load it", stacklevel=2)
    return dict(extra)
