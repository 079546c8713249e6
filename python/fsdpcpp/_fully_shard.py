"""fully_shard for nn.Module: finds the group's parameters and inner groups in the module tree,
registers it with the C++ core (fsdp/group.h), and hooks the module's forward."""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn
import torch.distributed.fsdp as _fsdp2
from torch.utils._pytree import tree_flatten, tree_map

from . import _C, _dtensor, _runtime
from ._runtime import _ensure_init, _updated, device

# A weight's attribute (set by fsdpcpp.float8's conversion): fully_shard marks it for the runtime to
# gather in float8 (fsdp::enable_float8_all_gather).
FLOAT8_ALL_GATHER = "_fsdpcpp_float8_all_gather"


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
        meta keeps the shards fully_shard allocated; a new dtype or device is refused
        (_dtensor.py)."""
        caller = f"fsdpcpp: {type(self).__name__}._apply (to_empty, to, ...)"
        try:
            module = super()._apply(fn, recurse)
        except BaseException:
            # An inner sharded module refused: this one's faces are put back too, its error kept.
            self._fsdpcpp.faces.take_replacements(caller, mode="apply", refuse=False)
            raise
        self._fsdpcpp.faces.take_replacements(caller, mode="apply")
        return module

    def reshard(self) -> None:
        """Frees the module's unsharded parameters now, if it holds them; the module holds its
        sharded DTensors again."""
        self._fsdpcpp.group.reshard()
        self._fsdpcpp.faces.use_faces()

    def unshard(self, async_op: bool = False):
        """As FSDP2's: all-gathers the module's parameters now. The module then holds them whole
        (plain tensors) until reshard() or the end of its next forward (with
        reshard_after_forward); that forward uses this all-gather. async_op=True returns a handle
        whose wait() ends it (the forward waits for it by itself)."""
        state = self._fsdpcpp
        # What a forward takes first (gradients zero_grad dropped, replaced parameters): the
        # all-gather sets the sharded gradients aside and reads the shards.
        state.faces.forward_settings()
        state.group.unshard()
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
        self._fsdpcpp.group.set_requires_gradient_sync(bool(requires_gradient_sync))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the modules free their unsharded parameters after forward (ZeRO-3) or keep them
        until backward."""
        modules = self.modules() if recurse else [self]
        for module in modules:
            if isinstance(module, FSDPModule):
                module._fsdpcpp.group.set_reshard_after_forward(bool(reshard_after_forward))

    def set_runtime_options(self, **options) -> None:
        """This root's scheduling options (names as fsdpcpp.runtime_options()), instead of the
        process-wide defaults: prefetch depth, the caps on in-flight collectives, bucketing."""
        group = self._fsdpcpp.group
        group.set_runtime_options(_updated(group.runtime_options(), options, "FSDPModule.set_runtime_options"))


class _UnshardHandle:
    """FSDPModule.unshard(async_op=True)'s handle, as FSDP2's UnshardHandle."""

    def __init__(self, state):
        self._state = state

    def wait(self) -> None:
        self._state.group.wait_for_unshard()
        self._state.faces.use_managed()


class _RecomputedInBackward:
    """Mixed in before FSDPModule where the memory-budget planner recomputes a module in backward:
    its whole call, the all-gather hooks included, runs under non-reentrant checkpointing (as
    torch.utils.checkpoint.checkpoint(module, ...) around the call would)."""

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().__call__(*args, **kwargs)
        # Its backward starts at the recompute, which runs the whole call (no early stop): the
        # group's post-forward hook ends the recompute and starts the backward proper.
        with _C.recomputed_forward():
            return torch.utils.checkpoint.checkpoint(super().__call__, *args, use_reentrant=False, early_stop=False,
                                                     **kwargs)


class _GroupState:
    __slots__ = ("group", "mp_policy", "module_class", "faces", "module_list", "forwards_begun", "hooks_in_backward")

    def __init__(self, group, mp_policy, module_class, faces, module_list=None):
        self.forwards_begun = 0  # this module's forwards whose pre-forward hook completed, not yet ended
        self.hooks_in_backward = False  # the group runs its faces' post-accumulate-grad hooks in backward
        self.group = group
        self.mp_policy = mp_policy
        self.module_class = module_class  # the class before fully_shard mixed FSDPModule in
        self.faces = faces  # the parameters' DTensor faces (_dtensor.py)
        self.module_list = module_list  # a _ModuleList where one fully_shard call took a list of modules


class _ModuleList:
    """fully_shard([a, b, ...]): one group for several modules. Its forward starts when the first
    of them starts and ends once each has run (FSDP2's rule), or with the forward of the module
    around it where one of them did not run this time (a head a forward skipped); so the group is
    all-gathered once and its backward starts at whichever of their outputs' gradients comes
    first."""

    __slots__ = ("members", "waiting", "outputs", "state")

    def __init__(self, modules):
        self.members = frozenset(id(m) for m in modules)
        self.waiting = set()  # the modules yet to run in the current forward; empty: none running
        self.outputs = []
        self.state = None  # the group's _GroupState (its C++ group and faces)

    def starts_forward(self, module) -> bool:
        """Whether `module`'s forward starts the group's."""
        if self.waiting:
            return False
        self.waiting = set(self.members)
        _open_lists.append(self)
        return True

    def ends_forward(self, module, outputs):
        """The outputs of the group's whole forward once `module` was the last to run, else None."""
        self.outputs += outputs
        self.waiting.discard(id(module))
        return None if self.waiting else self._close()

    def end_early(self) -> None:
        """Ends the group's forward with the outputs of the modules that ran."""
        outputs = self._close()
        self.state.group.post_forward(outputs)
        _dtensor.exit_forward(self.state.faces, outputs)

    def end_aborted(self) -> None:
        """Ends the group's forward as a forward that raised ends (group_abort_forward)."""
        self._close()
        self.state.group.abort_forward()
        _dtensor.exit_forward(self.state.faces, [])

    def abort(self) -> None:
        if self.waiting:
            self._close()

    def _close(self):
        _open_lists.remove(self)
        outputs, self.outputs, self.waiting = self.outputs, [], set()
        return outputs


_open_lists: list[_ModuleList] = []  # lists whose forward started and has not ended, oldest first


def _end_groups_inside(state, raised: bool) -> None:
    """Before the forward of the module around them ends (every forward still running but its
    own is an open group's), the groups whose modules did not all run end theirs; as aborted
    where that forward raised."""
    if _open_lists and state.module_list is None and _dtensor.forward_depth() == 1 + len(_open_lists):
        for module_list in reversed(list(_open_lists)):
            module_list.end_aborted() if raised else module_list.end_early()


def set_recomputed(module: FSDPModule, recompute: bool) -> None:
    """Whether the sharded `module` runs its whole call, the all-gather included, under
    non-reentrant torch.utils.checkpoint (the memory-budget planner's per-module choice)."""
    if not isinstance(module, FSDPModule):
        raise ValueError(f"fsdpcpp.set_recomputed({type(module).__name__}): the module is not sharded; "
                         "fully_shard it first")
    if recompute and module._fsdpcpp.module_list is not None:
        raise NotImplementedError(f"fsdpcpp.set_recomputed({type(module).__name__}): the module was sharded in a "
                                  "list with others (one group); recomputing one module of a group is not supported")
    module.__class__ = _fsdp_class(module._fsdpcpp.module_class, recompute)


def is_recomputed(module: FSDPModule) -> bool:
    return isinstance(module, _RecomputedInBackward)


def _cast_floating(dtype, tree):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


@torch._dynamo.disable
def _pre_forward(module, args, kwargs):
    state = module._fsdpcpp
    if state.module_list is None or state.module_list.starts_forward(module):
        # Either both begin or neither: a refusal (a replaced parameter) or a failed all-gather
        # leaves the runtime as it was, and the post-forward hook that runs for the raised forward
        # (always_call) sees no forward begun.
        try:
            _dtensor.enter_forward(state.faces)
            try:
                state.group.pre_forward()
            except BaseException:
                _dtensor.exit_forward(state.faces, [])
                raise
            state.faces.use_managed()  # after the unshard: a tp part's DTensor views the gathered rows
            _follow_post_accumulate_grad_hooks(state)
        except BaseException:
            if state.module_list is not None:
                state.module_list.abort()
            raise
    state.forwards_begun += 1
    mp = state.mp_policy
    if mp.cast_forward_inputs and mp.param_dtype is not None:
        args, kwargs = _cast_floating(mp.param_dtype, (args, kwargs))
    return args, kwargs


def _follow_post_accumulate_grad_hooks(state: _GroupState) -> None:
    """Where the group's faces have post-accumulate-grad hooks, the runtime calls them once the
    group's gradients are reduced in backward (FSDP2 runs them after each reduce-scatter), through
    a weak reference: the C++ group must not keep the faces and their parameters alive."""
    wanted = state.faces.has_post_accumulate_grad_hooks()
    if wanted == state.hooks_in_backward:
        return
    faces = weakref.ref(state.faces)

    def run():
        live = faces()
        if live is not None:
            live.run_hooks_in_backward()

    state.group.set_hooks_in_backward(run if wanted else None)
    state.hooks_in_backward = wanted


@torch._dynamo.disable
def _post_forward(module, args, kwargs, output):
    state = module._fsdpcpp
    if state.forwards_begun == 0:
        return output  # its pre-forward hook raised: nothing began
    state.forwards_begun -= 1
    if sys.exc_info()[1] is not None:
        # Called for a forward that raised (always_call): its bookkeeping ends, the parameters stay
        # as they are. Non-reentrant checkpointing stops a recomputation this way once it has the
        # tensors backward needs, and backward still reads the gathered parameters after it.
        if state.module_list is not None:
            state.module_list.abort()
        _end_groups_inside(state, raised=True)
        state.group.abort_forward()
        _dtensor.exit_forward(state.faces, [])
        return output
    leaves, _ = tree_flatten(output)
    outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
    if state.module_list is not None:
        outputs = state.module_list.ends_forward(module, outputs)
    _end_groups_inside(state, raised=False)
    if outputs is not None:
        state.group.post_forward(outputs)
        _dtensor.exit_forward(state.faces, outputs)
    if state.mp_policy.output_dtype is not None:
        output = _cast_floating(state.mp_policy.output_dtype, output)
    return output


def _group_parameters(modules, name: str, ignored: set):
    """The parameters this call shards: those of `modules` no inner fully_shard took and not in
    `ignored` (ids), each tensor once (a weight tied within them is one parameter under its first
    name)."""
    params, seen = [], set(ignored)
    for module in modules:
        inner_prefixes = [prefix for prefix, sub in module.named_modules() if prefix and isinstance(sub, FSDPModule)]
        for param_name, param in module.named_parameters(remove_duplicate=False):
            param = _dtensor.managed(param)
            owner = _C.group_name_of_parameter(param)
            if owner is not None:
                if not any(param_name.startswith(prefix + ".") for prefix in inner_prefixes):
                    raise ValueError(
                        f"fsdpcpp.fully_shard({name}): parameter '{param_name}' is already managed by "
                        f"fully_shard({owner}). Apply fully_shard bottom-up (inner modules first, the root last), "
                        "and shard modules that share a weight (e.g. a tied embedding and output head) in one "
                        "fully_shard call: their parent, or a list of both.")
                continue
            if id(param) in seen:
                continue
            seen.add(id(param))
            params.append((param_name, param))
    return params


def _check_placements(shard_placement_fn, params, name: str) -> None:
    """FSDP2's shard_placement_fn, where it asks for what the runtime does: rows (Shard(0)) or
    None (the default) for every parameter. Any other dimension is refused, naming the parameter."""
    if shard_placement_fn is None:
        return
    for param_name, param in params:
        placement = shard_placement_fn(param)
        if placement is not None and getattr(placement, "dim", None) != 0:
            raise NotImplementedError(
                f"fsdpcpp.fully_shard({name}): shard_placement_fn gave {placement!r} for '{param_name}': only Shard(0) "
                "(or None) is supported; the runtime shards every parameter by rows")


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


def fully_shard(module: nn.Module | list[nn.Module], *, mesh=None, reshard_after_forward: bool | None = None,
                shard_placement_fn=None, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params=None):
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
    A list of modules is one group (as FSDP2's): gathered when the first of them starts its forward,
    freed once each has run or when the forward around them ends (e.g. a final norm and the output
    head); each becomes an FSDPModule.
    mesh: a 1-D DeviceMesh over every rank (FSDP2's default, made when none is given), or a 2-D
    (replicate, shard) one from init_device_mesh: HSDP, each replica shards the model over its
    ranks and the gradients are averaged across replicas. Either may be the dp dims of a mesh whose
    last dim torch's tensor parallelism split the model over (mesh["dp"] of a ("dp", "tp") mesh):
    each DTensor parameter's tp part is sharded over the dp ranks, as FSDP2 does. One mesh for
    every module.
    reshard_after_forward: True frees the unsharded parameters after forward, False keeps them for
    backward; None (FSDP2's default) is True here for every module, the root's too (FSDP2 keeps a
    root's): its backward all-gather is prefetched, and the memory-budget planner decides which
    modules to keep.
    ignored_params: parameters this call leaves alone (as FSDP2): not sharded, not moved, their
    gradients not reduced across ranks. shard_placement_fn: accepted where it returns Shard(0) or
    None for each parameter (what the runtime does), refused otherwise."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    types = [type(m).__name__ for m in modules]
    name = types[0] if len(types) == 1 else f"[{', '.join(types)}]"
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fsdpcpp.fully_shard: expected an nn.Module or a list of them, got {name}")
    if any(isinstance(m, FSDPModule) for m in modules):
        raise ValueError(f"fsdpcpp.fully_shard({name}): already sharded: call fully_shard once per module")
    offload = _offloads(offload_policy, name)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(f"fsdpcpp.fully_shard({name}): reshard_after_forward={reshard_after_forward!r}: "
                                  "True, False or None (resharding to a smaller group of ranks is not supported)")
    _ensure_init()
    dp_comms = _dtensor.use_mesh(mesh, f"fsdpcpp.fully_shard({name})")
    members = {id(m) for m in modules}
    inner_modules = list({id(sub): sub for m in modules for sub in m.modules()
                          if id(sub) not in members and isinstance(sub, FSDPModule)}.values())
    inner = list({id(sub._fsdpcpp.group): sub._fsdpcpp.group for sub in inner_modules}.values())
    params = _group_parameters(modules, name, {id(_dtensor.managed(p)) for p in ignored_params or ()})
    _check_placements(shard_placement_fn, params, name)
    params = _dtensor.take_tp_parts(modules, params, f"fsdpcpp.fully_shard({name})")
    _off_meta(params)
    for _, param in params:
        if getattr(param, FLOAT8_ALL_GATHER, False):
            _C.enable_float8_all_gather(param)
    group = _C.shard_group(name, params, inner, mp_policy.param_dtype, mp_policy.reduce_dtype,
                           reshard_after_forward is not False, offload, dp_comms)
    faces = _dtensor.make_faces(modules, params, inner_modules)
    module_list = _ModuleList(modules) if len(modules) > 1 else None
    for m in modules:
        m._fsdpcpp = _GroupState(group, mp_policy, type(m), faces, module_list)
        # FSDP2's marks of a module it manages, set as FSDP2 sets them: transformers' generate()
        # then defaults to synced_gpus (running forwards on a rank that finished until every rank
        # has, so the all-gathers stay paired), and dynamo compiles it as FSDP2's (without
        # parameter guards; the first mark alone makes dynamo refuse the module: nothing compiles).
        m._is_fsdp_managed_module = True
        m._fsdp_use_orig_params = True
        m.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_forward, prepend=False, with_kwargs=True, always_call=True)
        # FSDP2's FSDPModule methods on this module alone: a class made once per module class.
        m.__class__ = _fsdp_class(type(m), recompute=False)
    if module_list is not None:
        module_list.state = modules[0]._fsdpcpp  # any member's: they share the group and the faces
    return module


def _offloads(offload_policy, name: str) -> bool:
    """Whether the policy (fsdpcpp's or torch's own, as FSDP2 scripts import it) is CPU offload."""
    cpu = isinstance(offload_policy, (CPUOffloadPolicy, _fsdp2.CPUOffloadPolicy))
    if cpu and not offload_policy.pin_memory:
        raise NotImplementedError(f"fsdpcpp.fully_shard({name}): CPUOffloadPolicy(pin_memory=False) is not supported")
    return cpu


_classes: dict[tuple[type, bool], type] = {}


def _fsdp_class(cls: type, recompute: bool) -> type:
    if (cls, recompute) not in _classes:
        bases = (_RecomputedInBackward, FSDPModule, cls) if recompute else (FSDPModule, cls)
        methods = {"save_pretrained": _save_pretrained} if hasattr(cls, "save_pretrained") else {}
        _classes[cls, recompute] = type(f"{'Recomputed' if recompute else ''}FSDP{cls.__name__}", bases, methods)
    return _classes[cls, recompute]


def _save_pretrained(self, save_directory, is_main_process: bool | None = None, state_dict=None, **kwargs):
    """transformers' save_pretrained on the sharded model (which under FSDP2 fails reading the
    DTensors' storage): the full state dict is gathered one parameter at a time, rank 0 keeping it
    (fsdpcpp.get_model_state_dict(rank0_only=True)), and rank 0 (or is_main_process) writes the
    files. Collective: every rank calls it. A state_dict given is written as it is."""
    from ._state import get_model_state_dict
    if state_dict is None:
        state_dict = get_model_state_dict(self, rank0_only=is_main_process is None)
    if is_main_process is None:
        is_main_process = _runtime.rank() == 0
    if is_main_process:
        self._fsdpcpp.module_class.save_pretrained(self, save_directory, is_main_process=True, state_dict=state_dict,
                                                   **kwargs)


def use_as_fsdp2() -> None:
    """Opt-in for libraries that shard with FSDP2 themselves (accelerate's FSDP2 path, and so
    transformers' Trainer): from this call on, torch.distributed.fsdp.fully_shard and FSDPModule
    are fsdpcpp's in this process, so code that imports them when it shards (accelerate does, in
    Accelerator.prepare) shards with fsdpcpp. Process-wide: FSDP2 itself is then unreachable by
    those names. Call it after fsdpcpp.init() and before the library shards the model."""
    _fsdp2.fully_shard = fully_shard
    _fsdp2.FSDPModule = FSDPModule
