"""Whole-model views of sharded state: the global gradient norm, full state dicts out and in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from . import _C
from ._dtensor import copy_my_rows, managed, refuse_tp_parts, take_replacements_in, tp_spec_of
from ._runtime import rank


def _named(parameters, caller: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    named = [(f"parameter {i}", managed(p)) for i, p in enumerate(parameters)]
    refuse_tp_parts(named, caller, "torch.nn.utils.clip_grad_norm_ (or torchtitan's clip) over the DTensor parameters")
    return named


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scales the sharded gradients of `parameters` (every one sharded by fully_shard) so that
    their global L2 norm is at most max_norm, and returns the norm before clipping (a float32
    scalar on the device) without waiting for the device: torch.nn.utils.clip_grad_norm_ over all
    ranks. Collective."""
    if norm_type != 2.0:
        raise NotImplementedError("fsdpcpp.clip_grad_norm_: only the L2 norm (norm_type=2) is supported")
    return _C.clip_grad_norm_(_named(parameters, "fsdpcpp.clip_grad_norm_"), float(max_norm))


def full_parameter(param: torch.Tensor) -> torch.Tensor:
    """A full (unsharded) copy of a sharded parameter, on the device. Collective over its group
    (with tensor parallelism, over every rank)."""
    if tp_spec_of(managed(param)) is not None:
        return param.full_tensor()
    return _C.full_parameter(managed(param))


def get_model_state_dict(model: nn.Module, *, cpu_offload: bool = True,
                         rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of `model` on every rank, by the names model.state_dict()
    uses (so transformers' save_pretrained(state_dict=...) and load_state_dict on an unsharded copy
    take it), on the host unless cpu_offload=False. As torch.distributed.checkpoint's
    get_model_state_dict with StateDictOptions(full_state_dict=True). rank0_only=True: rank 0
    alone keeps the tensors (the others return {}), gathered one parameter at a time, so no other
    rank ever holds more than one full parameter (FSDP1's FullStateDictConfig(rank0_only=True)).
    Collective: every rank calls it."""
    take_replacements_in(model, "fsdpcpp.get_model_state_dict")
    keep = not rank0_only or rank() == 0
    full = {}
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            if _C.is_sharded_parameter(managed(value)):
                value = full_parameter(value)
            elif keep:
                value = value.detach().clone()
            if keep:
                full[name] = value.cpu() if cpu_offload else value
    return full


def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Loads a full (unsharded) state dict into the sharded `model`: each rank copies its rows of
    every sharded parameter, and whole tensors into the rest. Not collective. strict=True raises
    naming missing and unexpected keys and shapes that differ, as load_state_dict does."""
    take_replacements_in(model, "fsdpcpp.set_model_state_dict")
    faces = model.state_dict(keep_vars=True)
    own = {name: managed(value) for name, value in faces.items()}
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"fsdpcpp.set_model_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for name, target in own.items():
            if name not in state_dict:
                continue
            source = state_dict[name]
            if _C.is_sharded_parameter(target):
                full_shape = list(faces[name].shape)
                if list(source.shape) != full_shape:
                    raise ValueError(f"fsdpcpp.set_model_state_dict: '{name}' has shape {list(source.shape)} in the "
                                     f"state dict but {full_shape} in the model")
                copy_my_rows(source, target, getattr(faces[name], "_spec", None))
            else:
                if source.shape != target.shape:
                    raise ValueError(f"fsdpcpp.set_model_state_dict: '{name}' has shape {list(source.shape)} in the "
                                     f"state dict but {list(target.shape)} in the model")
                target.copy_(source)
