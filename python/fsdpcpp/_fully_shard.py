"""fully_shard for nn.Module: finds the unit's parameters and inner units in the module tree,
registers it with the C++ core (fsdp/unit.h), and hooks the module's forward."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from . import _C, _dtensor
from ._runtime import _ensure_init, _updated, device


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As FSDP2's: parameters are all-gathered and used in param_dtype, gradients reduce-scattered
    in reduce_dtype (default: param_dtype); the sharded parameters, their gradients and the
    optimizer state keep the parameters' dtype. output_dtype casts the module's floating outputs;
    cast_forward_inputs casts its floating inputs to param_dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (FSDP2's default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """As FSDP2's: the sharded parameters live in pinned host memory and are copied in inside each
    all-gather; the sharded gradients go back to the host, where an optimizer made after sharding
    steps. pin_memory=False is not supported (the copies overlap compute only from pinned memory)."""

    pin_memory: bool = True


class FSDPModule:
    """Mixed into the class of every module fully_shard shards (as FSDP2 does), for its methods."""

    def _apply(self, fn, recurse=True):
        """nn.Module._apply (to_empty, to, cuda, float, ...), then the sharded parameters'
        DTensor faces are again the runtime's shards: to_empty(device=...) of a model sharded on
        meta keeps the shards fully_shard allocated (_dtensor.py)."""
        module = super()._apply(fn, recurse)
        self._fsdpcpp.faces.rebind(f"fsdpcpp: {type(self).__name__}._apply (to_empty, to, ...)")
        return module

    def reshard(self) -> None:
        """Frees the module's unsharded parameters now, if it holds them; the module holds its
        sharded DTensors again."""
        self._fsdpcpp.unit.reshard()
        self._fsdpcpp.faces.use_faces()

    def unshard(self, async_op: bool = False):
        """As FSDP2's: all-gathers the module's parameters now. The module then holds them whole
        (plain tensors) until reshard() or the end of its next forward (with
        reshard_after_forward); that forward uses this all-gather. async_op=True returns a handle
        whose wait() ends it (the forward waits for it by itself)."""
        state = self._fsdpcpp
        state.unit.unshard()
        handle = _UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    # FSDP2's scheduling hints. The runtime already does what they ask for, from the order it
    # records each step and with events (docs/python.md): accepted, with nothing to do.
    def set_modules_to_forward_prefetch(self, modules) -> None:
        """Accepted: the runtime prefetches the next modules of the order recorded in the previous
        step (activation recomputation included); set_runtime_options(prefetch_depth=N) sets how far."""

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """Accepted: as set_modules_to_forward_prefetch, in backward order."""

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: the runtime ends each backward itself (its end-of-backward callback)."""

    def set_post_optim_event(self, event) -> None:
        """Accepted: each all-gather already waits for the compute stream's position at its issue,
        where the optimizer's writes to the shards are."""

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Accepted: under HSDP the gradients are all-reduced across replicas after every backward;
        skipping it for all but the last micro-batch saves communication, not a different result."""

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """True (FSDP2's default) is what the runtime does; False is not supported."""
        if not reshard_after_backward:
            raise NotImplementedError("fsdpcpp: set_reshard_after_backward(False) is not supported: the runtime "
                                      "frees the unsharded parameters after each module's backward")

    def set_gradient_divide_factor(self, factor: float) -> None:
        raise NotImplementedError("fsdpcpp: set_gradient_divide_factor is not supported: gradients are averaged "
                                  "over the ranks (divided by the world size); scale the loss instead")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps the gradients unsharded and summed (gradient accumulation without
        communication); the first backward after True reduce-scatters the sums. Applies to this
        module and (recurse=True) every sharded module inside it."""
        if not recurse:
            raise NotImplementedError("fsdpcpp: set_requires_gradient_sync(recurse=False) is not supported")
        self._fsdpcpp.unit.set_requires_gradient_sync(bool(requires_gradient_sync))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the modules free their unsharded parameters after forward (ZeRO-3) or keep them
        until backward."""
        modules = self.modules() if recurse else [self]
        for module in modules:
            if isinstance(module, FSDPModule):
                module._fsdpcpp.unit.set_reshard_after_forward(bool(reshard_after_forward))

    def set_runtime_options(self, **options) -> None:
        """This root's scheduling options (names as fsdpcpp.runtime_options()), instead of the
        process-wide defaults: prefetch depth, the caps on in-flight collectives, bucketing."""
        unit = self._fsdpcpp.unit
        unit.set_runtime_options(_updated(unit.runtime_options(), options, "FSDPModule.set_runtime_options"))


class _UnshardHandle:
    """FSDPModule.unshard(async_op=True)'s handle, as FSDP2's UnshardHandle."""

    def __init__(self, state):
        self._state = state

    def wait(self) -> None:
        self._state.unit.wait_for_unshard()
        self._state.faces.use_managed()


class _RecomputedInBackward:
    """Mixed in before FSDPModule where the memory-budget planner recomputes a module in backward:
    its whole call, the all-gather hooks included, runs under non-reentrant checkpointing (as
    torch.utils.checkpoint.checkpoint(module, ...) around the call would)."""

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().__call__(*args, **kwargs)
        # Its backward starts at the recompute, which runs the whole call (no early stop): the
        # unit's post-forward hook ends the recompute and starts the backward proper.
        with _C.checkpointed_forward():
            return torch.utils.checkpoint.checkpoint(super().__call__, *args, use_reentrant=False, early_stop=False,
                                                     **kwargs)


class _UnitState:
    __slots__ = ("unit", "mp_policy", "module_class", "faces")

    def __init__(self, unit, mp_policy, module_class, faces):
        self.unit = unit
        self.mp_policy = mp_policy
        self.module_class = module_class  # the class before fully_shard mixed FSDPModule in
        self.faces = faces  # the parameters' DTensor faces (_dtensor.py)


def set_recomputed(module: FSDPModule, recompute: bool) -> None:
    """Whether the sharded `module` runs its whole call, the all-gather included, under
    non-reentrant torch.utils.checkpoint (the memory-budget planner's per-module choice)."""
    if not isinstance(module, FSDPModule):
        raise ValueError(f"fsdpcpp.set_recomputed({type(module).__name__}): the module is not sharded; "
                         "fully_shard it first")
    module.__class__ = _fsdp_class(module._fsdpcpp.module_class, recompute)


def is_recomputed(module: FSDPModule) -> bool:
    return isinstance(module, _RecomputedInBackward)


def _cast_floating(dtype, tree):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


@torch._dynamo.disable
def _pre_forward(module, args, kwargs):
    state = module._fsdpcpp
    _dtensor.enter_forward(state.faces)
    state.unit.pre_forward()
    mp = state.mp_policy
    if mp.cast_forward_inputs and mp.param_dtype is not None:
        args, kwargs = _cast_floating(mp.param_dtype, (args, kwargs))
    return args, kwargs


@torch._dynamo.disable
def _post_forward(module, args, kwargs, output):
    state = module._fsdpcpp
    if sys.exc_info()[1] is not None:
        # Called for a forward that raised (always_call): its bookkeeping ends, the parameters stay
        # as they are. Non-reentrant checkpointing stops a recomputation this way once it has the
        # tensors backward needs, and backward still reads the gathered parameters after it.
        state.unit.abort_forward()
        _dtensor.exit_forward(state.faces, [])
        return output
    leaves, _ = tree_flatten(output)
    outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
    state.unit.post_forward(outputs)
    _dtensor.exit_forward(state.faces, outputs)
    if state.mp_policy.output_dtype is not None:
        output = _cast_floating(state.mp_policy.output_dtype, output)
    return output


def _unit_parameters(module: nn.Module, name: str):
    """The parameters this call shards: those no inner fully_shard took, each tensor once (a weight
    tied within the module is one parameter under its first name)."""
    inner_prefixes = [prefix for prefix, sub in module.named_modules() if prefix and isinstance(sub, FSDPModule)]
    params, seen = [], set()
    for param_name, param in module.named_parameters(remove_duplicate=False):
        param = _dtensor.managed(param)
        owner = _C.unit_name_of_parameter(param)
        if owner is not None:
            if not any(param_name.startswith(prefix + ".") for prefix in inner_prefixes):
                raise ValueError(
                    f"fsdpcpp.fully_shard({name}): parameter '{param_name}' is already managed by "
                    f"fully_shard({owner}). Apply fully_shard bottom-up (inner modules first, the root last), and "
                    "shard modules that share a weight (e.g. a tied embedding and output head) in one fully_shard "
                    "call that contains both.")
            continue
        if id(param) in seen:
            continue
        seen.add(id(param))
        params.append((param_name, param))
    return params


def _off_meta(params) -> None:
    """A parameter built on meta (FSDP2's way to build a model larger than one device) becomes, in
    place (the same Python object: whatever holds it still does), a tensor of its shape on the
    ranks' device that takes no memory (fsdp::deferred_parameter: one zero, stride 0). Sharding
    then allocates only this rank's rows, zeros, for an init or a state dict to fill."""
    for _, param in params:
        if param.is_meta:
            placed = nn.Parameter(_C.deferred_parameter(list(param.shape), param.dtype, str(device())),
                                  requires_grad=param.requires_grad)
            placed.__dict__.update(param.__dict__)
            torch.utils.swap_tensors(param, placed)


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | None = None, shard_placement_fn=None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params=None) -> nn.Module:
    """Shards the parameters of `module` not already sharded by an inner fully_shard call into one
    group: all-gathered before its forward, reduce-scattered after its backward. Apply bottom-up
    (each block, then the root). Collective: every rank shards the same model in the same order.
    The parameters stay the same Python objects, now holding this rank's rows (dim 0, zero-padded
    where rows do not divide evenly), so an optimizer made before or after trains the same way.
    A module built on the meta device (with torch.device("meta"): ...) is sharded as FSDP2 shards
    it: each rank allocates only its rows (zeros); module.to_empty(device=...) keeps them, and an
    init (reset_parameters, transformers' init_weights) or a full state dict
    (set_model_state_dict with broadcast_from_rank0) fills them.
    Returns `module`, whose class now also derives from FSDPModule (as FSDP2).
    mesh: a 1-D DeviceMesh over every rank (FSDP2's default, made when none is given), or a 2-D
    (replicate, shard) one from init_device_mesh: HSDP, each replica shards the model over its
    ranks and the gradients are averaged across replicas. One mesh for every module.
    reshard_after_forward: True frees the unsharded parameters after forward, False keeps them for
    backward; None (FSDP2's default) is True here for every module, the root's too (FSDP2 keeps a
    root's): its backward all-gather is prefetched, and the memory-budget planner decides which
    modules to keep."""
    name = type(module).__name__
    if not isinstance(module, nn.Module):
        raise TypeError(f"fsdpcpp.fully_shard: expected an nn.Module, got {type(module).__name__} (a list of "
                        "modules sharded as one group is not supported: shard their parent)")
    for unsupported, value in (("shard_placement_fn", shard_placement_fn), ("ignored_params", ignored_params)):
        if value is not None:
            raise NotImplementedError(f"fsdpcpp.fully_shard({name}): {unsupported}= is not supported (docs/python.md)")
    if isinstance(offload_policy, CPUOffloadPolicy) and not offload_policy.pin_memory:
        raise NotImplementedError(f"fsdpcpp.fully_shard({name}): CPUOffloadPolicy(pin_memory=False) is not supported")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(f"fsdpcpp.fully_shard({name}): reshard_after_forward={reshard_after_forward!r}: "
                                  "True, False or None (resharding to a smaller group of ranks is not supported)")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fsdpcpp.fully_shard({name}): this module is already sharded: call fully_shard once per module")
    _ensure_init()
    hsdp = _dtensor.use_mesh(mesh, f"fsdpcpp.fully_shard({name})")
    inner_modules = [sub for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)]
    inner = [sub._fsdpcpp.unit for sub in inner_modules]
    params = _unit_parameters(module, name)
    _off_meta(params)
    unit = _C.shard_unit(name, params, inner, mp_policy.param_dtype, mp_policy.reduce_dtype,
                         reshard_after_forward is not False, isinstance(offload_policy, CPUOffloadPolicy), hsdp)
    module._fsdpcpp = _UnitState(unit, mp_policy, type(module), _dtensor.make_faces(module, params, inner_modules))
    # FSDP2's marks of a module it manages, set as FSDP2 sets them: transformers' generate() then
    # defaults to synced_gpus (running forwards on a rank that finished until every rank has, so
    # the all-gathers stay paired), and dynamo compiles it as FSDP2's (without parameter guards;
    # the first mark alone makes dynamo refuse the module: nothing compiles).
    module._is_fsdp_managed_module = True
    module._fsdp_use_orig_params = True
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward, prepend=False, with_kwargs=True, always_call=True)
    # FSDP2's FSDPModule methods on this module alone: a class made once per module class.
    module.__class__ = _fsdp_class(type(module), recompute=False)
    return module


_classes: dict[tuple[type, bool], type] = {}


def _fsdp_class(cls: type, recompute: bool) -> type:
    if (cls, recompute) not in _classes:
        bases = (_RecomputedInBackward, FSDPModule, cls) if recompute else (FSDPModule, cls)
        _classes[cls, recompute] = type(f"{'Recomputed' if recompute else ''}FSDP{cls.__name__}", bases, {})
    return _classes[cls, recompute]
