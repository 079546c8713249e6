"""Sharded parameters as torch sees them: DTensors, as FSDP2's.

The runtime shards each parameter in place: outside forward the tensor the C++ core manages holds
this rank's rows. To torch that is an ordinary tensor, so its own helpers (clip_grad_norm_,
get_total_norm, state_dict, DCP, get_model_state_dict, numel) would see one rank's share as the
whole. So fully_shard registers, in the module, a DTensor "face" of each managed parameter:
Shard(0) over the ranks (HSDP: (Replicate(), Shard(0)) over replicas and shards; FSDP2's layout:
ceil division, the last ranks short), whose local tensor
is the managed tensor's storage. Outside forward the module holds the face; its forward pre-hook
puts the managed tensor back for the forward (which the runtime all-gathers into), the post-hook
the face again. At the end of each backward the managed gradients are mirrored as the faces'
gradients (the same storage); an optimizer steps either object and both see it. An optimizer
made before fully_shard holds the managed tensors and trains as before.

With tensor parallelism (torch's parallelize_module on the "tp" dim of a (dp, tp) mesh, then
fully_shard(mesh=mesh["dp"]), as FSDP2 composes them) a parameter arrives as a DTensor on the tp
mesh. The runtime manages its local (tp) part, sharded over the dp ranks that hold the same tp
part; its face is 2-D as FSDP2's ((_Strided)Shard(0) over dp, the tp placement over tp), and in
forward the module holds DTensor.from_local of the gathered part on the tp mesh, whose gradient
reaches the managed tensor (redistributed to the tp placement first, as FSDP2 does).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from . import _C
from . import _runtime
from ._runtime import device, rank, world_size

_mesh = None  # the dp DeviceMesh of every face (fully_shard's mesh=)
_dp_comms = None  # the C++ communicators of its dims where they are not all ranks (HSDP, tp > 1), else None
_tp = 1  # ranks each layer is split over (tensor parallelism): the world over the dp mesh's size
_spmd_meshes = {}  # (dp mesh, tp mesh) -> the (dp..., tp) mesh of the faces of their parameters
_live_faces = weakref.WeakSet()  # the _Faces of every live sharded module
_forward_depth = 0  # sharded forwards in progress: 0 outside the outermost
_mirror_queued = False


def _ensure_process_group() -> None:
    """DeviceMesh, DTensor and DCP need torch.distributed's default process group. A script that
    made one keeps it; otherwise one is made here over the same ranks (gloo on CPU ranks, NCCL
    with gloo for CPU tensors on GPUs), meeting at a store rank 0 serves, whose address travels
    by fsdp.cpp's own communicator."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size() or dist.get_rank() != rank():
            raise ValueError(f"fsdpcpp: torch.distributed's process group has rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, fsdp.cpp's communicator rank {rank()} of {world_size()}: "
                             "launch both over the same processes")
        return
    store = None
    address = torch.zeros(258, dtype=torch.long, device=device())
    if rank() == 0:
        host = os.environ.get("MASTER_ADDR") or (socket.gethostname() if world_size() > 1 else "127.0.0.1")
        store = dist.TCPStore(host, 0, world_size(), is_master=True, wait_for_workers=False)
        encoded = host.encode()[:256]
        address[0], address[1] = store.port, len(encoded)
        address[2:2 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.long)
    _C.all_reduce(address, False)
    address = address.cpu()
    if rank() != 0:
        host = bytes(address[2:2 + int(address[1])].tolist()).decode()
        store = dist.TCPStore(host, int(address[0]), world_size(), is_master=False)
    backend = "cpu:gloo,cuda:nccl" if device().type == "cuda" else "gloo"
    _make_process_group(backend, store=store, rank=rank(), world_size=world_size())


def gloo_world():
    """A gloo process group over every rank, for fsdp.cpp's collectives alone: how CPU ranks meet
    without mpirun (fsdpcpp.init's "gloo" backend). Its own group, not the default one, so that the
    script's collectives (DCP's, say) and fsdp.cpp's never wait on each other's order. The default
    group is made first from torchrun's variables (or for this process alone, without any) where
    the script made none."""
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
            _make_process_group("gloo")
        else:
            _make_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.new_group(backend="gloo")


def _make_process_group(backend: str, **how) -> None:
    """dist.init_process_group, ended at exit before the interpreter's own shutdown (which would
    stop gloo's threads mid-call) unless this rank dies of an exception."""
    dist.init_process_group(backend, **how)
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """At exit: with gloo, a barrier first (bounded: another rank may be gone), so that no
    collective is left in its threads; none when this rank dies of an exception."""
    if not dist.is_initialized() or _runtime.exiting_on_error:
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        except RuntimeError:
            return  # another rank did not come: the launcher ends the job
    _let_go_of_the_groups()
    dist.destroy_process_group()


def _let_go_of_the_groups() -> None:
    """Drops the references to the process groups that outlive destroy_process_group(), so that it
    frees them and joins gloo's worker threads. Left running, those threads outlive the
    interpreter's shutdown, where one dropping the last reference to a Python tensor aborts the
    process (pytorch#190489). Two hold the default group:
    - the mesh's own handles on its groups (DeviceMesh._pg_registry): the mesh lives on in the
      DTensorSpecs that torch's sharding-propagation caches keep;
    - torch.distributed.nn.functional's functions, whose default argument `group=group.WORLD` was
      evaluated when the module was imported: after the default group was made (torch._dynamo
      imports it, and the first DTensor or AdamW step imports torch._dynamo), ten of them hold
      that group. To them None means the default group, so it replaces it."""
    registry = getattr(_mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()
    functional = sys.modules.get("torch.distributed.nn.functional")
    world = dist.group.WORLD
    for function in vars(functional).values() if functional else ():
        defaults = getattr(function, "__defaults__", None)
        if defaults and any(value is world for value in defaults):
            function.__defaults__ = tuple(None if value is world else value for value in defaults)


def default_mesh():
    """FSDP2's default: a 1-D mesh over every rank."""
    global _mesh
    if _mesh is None:
        _ensure_process_group()
        from torch.distributed.device_mesh import init_device_mesh
        _mesh = init_device_mesh(device().type, (world_size(),))
    return _mesh


def use_mesh(mesh, caller: str):
    """fully_shard's mesh=: the ranks to shard over, laid out as init_device_mesh lays out
    (replicate, shard, tp): a 1-D mesh over every rank (FSDP), a 2-D one (HSDP: replica r holds
    ranks r*S .. r*S+S-1, as fsdp::make_mesh), or either as the dp dims of a mesh whose last dim
    splits each layer (mesh["dp"], mesh["dp_replicate", "dp_shard"]: tensor parallelism, the tp
    ranks of each dp rank consecutive). The first mesh given is every module's (one layout for
    all while any sharded module lives; once none does, the next fully_shard may take another);
    None takes it, or FSDP2's default 1-D mesh. Returns the C++ communicators to shard over (None:
    all ranks)."""
    global _mesh, _dp_comms, _tp
    if _mesh is not None and not _live_faces:  # every module sharded over it is gone
        _mesh, _dp_comms, _tp = None, None, 1
        _spmd_meshes.clear()
    if mesh is None:
        default_mesh()
        return _dp_comms
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{caller}: mesh must be a torch.distributed DeviceMesh, not {type(mesh).__name__}")
    tp = world_size() // mesh.size() if world_size() % mesh.size() == 0 else 0
    if mesh.ndim > 2 or not tp or mesh.mesh.tolist() != _dp_ranks(tuple(mesh.shape), tp):
        raise NotImplementedError(
            f"{caller}: a mesh of shape {tuple(mesh.shape)} over ranks {mesh.mesh.tolist()} is not supported: fsdpcpp "
            f"shards over a 1-D mesh of all {world_size()} ranks, a 2-D (replicate, shard) one, or either as the dp "
            "dims of a (dp..., tp) mesh (mesh['dp']), laid out as init_device_mesh lays them out")
    if mesh.device_type != device().type:
        raise ValueError(f"{caller}: the mesh is on {mesh.device_type}, fsdpcpp's ranks on {device().type}")
    if _mesh is not None and mesh is not _mesh and (tuple(mesh.shape), tp) != (tuple(_mesh.shape), _tp):
        raise ValueError(f"{caller}: a mesh of shape {tuple(mesh.shape)} after one of shape {tuple(_mesh.shape)}: "
                         "shard every module over one mesh")
    if _mesh is None:
        _mesh, _tp = mesh, tp
        if mesh.ndim == 2 or tp > 1:
            _dp_comms = _C.make_mesh(mesh.shape[0] if mesh.ndim == 2 else 1, tp)
    return _dp_comms


def _dp_ranks(shape, tp: int) -> list:
    """The ranks of this rank's dp mesh of `shape` when `tp` consecutive ranks split each layer."""
    t, shards, replicas = rank() % tp, shape[-1], shape[0] if len(shape) == 2 else 1
    ranks = [[(replica * shards + shard) * tp + t for shard in range(shards)] for replica in range(replicas)]
    return ranks if len(shape) == 2 else ranks[0]


def release_dropped_gradients() -> None:
    """Frees now what each step's first forward would free (the planner measures from before it)."""
    for state in list(_live_faces):
        state.release_dropped_gradients()


def forward_depth() -> int:
    """Sharded forwards in progress (a recompute in backward counts too)."""
    return _forward_depth


def outermost() -> bool:
    """Whether no sharded forward is running (the next one is a root's), outside backward."""
    return _forward_depth == 0 and torch._C._current_graph_task_id() < 0


def managed(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor the runtime manages behind a face (the tensor itself if it is none)."""
    return getattr(tensor, "_fsdpcpp_managed", tensor)


class _Slot:
    """One place a managed parameter is registered: module._parameters[name]. `face` is what the
    module holds there outside forward: the DTensor face, or (a scalar, which has no rows to shard
    by) the managed tensor itself (spec None). `in_use`: what it holds in forward (the managed
    tensor, or with tensor parallelism a DTensor of it on the tp mesh)."""

    __slots__ = ("module", "name", "managed", "face", "spec", "in_use")

    def __init__(self, module, name, managed, face, spec):
        self.module, self.name, self.managed, self.face, self.spec = module, name, managed, face, spec
        self.in_use = managed

    def use_managed(self) -> None:
        tp_spec = tp_spec_of(self.managed)
        self.in_use = self.managed if tp_spec is None else DTensor.from_local(
            self.managed, tp_spec.mesh, tp_spec.placements, run_check=False, shape=tp_spec.shape,
            stride=tp_spec.stride)
        self.module._parameters[self.name] = self.in_use

    def path(self) -> str:
        """The parameter's name from the outermost sharded module that holds it (for errors)."""
        best = self.name
        for state in list(_live_faces):
            for owner in state.owners():
                for prefix, sub in owner.named_modules():
                    if sub is self.module and prefix and len(prefix) + len(self.name) + 1 > len(best):
                        best = f"{prefix}.{self.name}"
        return best

    def holds_its_face(self) -> bool:
        """Whether the module still holds the face the runtime made, facing the runtime's shard (or
        the runtime's tensor itself: unshard() puts it in until the forward)."""
        visible = self.module._parameters.get(self.name)
        if visible is self.managed or visible is self.in_use:
            return True
        if visible is not self.face:
            return False
        return self.spec is None or getattr(visible, "_local_tensor", None) is self.local

    @property
    def local(self):
        return self.managed.__dict__.get("_fsdpcpp_face_local")


class _Faces:
    """One sharded module's faces: every slot (module, attribute name) that holds a managed
    parameter, and the face registered there outside forward."""

    __slots__ = ("slots", "modules", "inner", "hooks_ran", "__weakref__")

    def __init__(self, slots, modules, inner):
        self.slots = slots  # [_Slot]
        self.modules = [weakref.ref(m) for m in modules]  # the group's (one, or a fully_shard list)
        self.inner = inner  # the _Faces of every sharded module inside it
        self.hooks_ran = False  # this backward's post-accumulate-grad hooks have run

    def under(self):
        """These faces and those of every sharded module inside."""
        return [self, *self.inner]

    def owners(self):
        return [m for m in (ref() for ref in self.modules) if m is not None]

    def use_managed(self) -> None:
        """After the unshard: what the module computes with, in every slot."""
        for slot in self.slots:
            slot.use_managed()

    def use_managed_in_backward(self, grad):
        self.use_managed()
        return grad

    def use_faces(self) -> None:
        for slot in self.slots:
            slot.in_use = slot.managed  # the forward's DTensor of the tp part is gone with the forward
            slot.module._parameters[slot.name] = slot.face

    def mirror_gradients(self) -> None:
        for slot in self.slots:
            if slot.spec is None:
                continue
            grad, face = slot.managed.grad, slot.face
            if grad is None:
                face.grad = None
            elif face.grad is None or face.grad._local_tensor is not grad:
                face.grad = DTensor(grad, slot.spec, requires_grad=False)

    def _hooked_faces(self):
        """The faces with post-accumulate-grad hooks, each once. A whole tensor's face is the
        runtime's own leaf, whose hooks autograd runs itself."""
        seen = set()
        for slot in self.slots:
            face = slot.face
            if slot.spec is not None and id(face) not in seen and getattr(face, "_post_accumulate_grad_hooks", None):
                seen.add(id(face))
                yield face

    def has_post_accumulate_grad_hooks(self) -> bool:
        return next(self._hooked_faces(), None) is not None

    def run_post_accumulate_grad_hooks(self) -> None:
        """FSDP2 runs a sharded parameter's post-accumulate-grad hooks once its gradient is reduced
        (PyTorch's recipe for the optimizer step in backward registers them); autograd never
        accumulates into a face, so they run here, once a backward for each face with a gradient:
        in backward once the group's gradients are reduced (the runtime calls
        run_hooks_in_backward), else at its end. A gradient a hook set to None (the optimizer's
        zero_grad) is then freed."""
        if self.hooks_ran:
            return
        self.hooks_ran = True
        for face in list(self._hooked_faces()):
            if face.grad is not None:
                for hook in face._post_accumulate_grad_hooks.values():
                    hook(face)
        self.release_dropped_gradients()

    def run_hooks_in_backward(self) -> None:
        """The runtime's call once this group's gradients are reduce-scattered in backward: the
        faces get them and their hooks run, so a hook's optimizer step frees them before the
        next groups' backward (FSDP2's timing)."""
        self.mirror_gradients()
        self.run_post_accumulate_grad_hooks()

    def release_dropped_gradients(self) -> None:
        """A gradient set to None on either object (zero_grad of an optimizer of faces, or of one
        made before fully_shard) goes on the other too, so its memory is freed."""
        for slot in self.slots:
            if slot.spec is None:
                continue
            if slot.face.grad is None and slot.managed.grad is not None:
                slot.managed.grad = None
            elif slot.managed.grad is None and slot.face.grad is not None:
                slot.face.grad = None

    def take_replacements(self, caller: str, mode: str = "set", refuse: bool = True) -> None:
        """What replaced a sharded parameter since fully_shard, or changed what its face holds,
        becomes the runtime's again, so the module never shows one tensor and computes with another.
        mode "set" (a forward, unshard(): setattr or register_parameter of a new DTensor) and
        "load" (load_state_dict, with assign=True as FSDP2's example and accelerate load full
        checkpoints, or swapping contents in): this rank's rows of the new value are copied into the
        runtime's shard (a DTensor of the face's layout gives its local rows, another DTensor is
        gathered) and the new DTensor object becomes the face, its identity kept (swap_tensors), so
        an optimizer made from model.parameters() after the replacement steps the shard. A plain
        full tensor loaded has its rows copied and the face goes back; set, it is refused (its
        holders could not step the shard). mode "apply" (nn.Module._apply: to_empty, to, cuda): the
        new contents are dropped and only dtype and device are checked. A weight tied across slots
        is one face again. A parameter removed (del, nn.utils.parametrize) or replaced by another
        sharded parameter, a new dtype, device or shape, and values on meta are refused, naming the
        parameter, once every slot holds a face again (refuse=False: only put back)."""
        by_param, problems, changed = {}, [], False
        for slot in self.slots:
            by_param.setdefault(id(slot.managed), []).append(slot)
        for slots in by_param.values():
            replaced = next((slot for slot in slots if not slot.holds_its_face()), None)
            if replaced is None:
                continue
            source = replaced.module._parameters.get(replaced.name)
            problem = _replacement_problem(replaced, source, mode)
            if problem:
                problems.append(f"'{replaced.path()}' {problem}")
                if not isinstance(source, torch.Tensor):
                    continue  # nothing to put a face in
            elif mode != "apply":
                with torch.no_grad():
                    copy_my_rows(source, replaced.managed, replaced.spec)
            if replaced.spec is None:
                face = replaced.managed  # a scalar: the runtime's own tensor goes back in
            else:
                # A DTensor taken keeps its identity; otherwise the runtime's face goes back.
                face = source if not problem and isinstance(source, DTensor) else replaced.face
                requires_grad = face.requires_grad
                face.grad = None  # swap_tensors refuses a tensor with a gradient; mirrored again below
                torch.utils.swap_tensors(face, _face(replaced.managed, replaced.spec, requires_grad))
            if replaced.managed.requires_grad != face.requires_grad:
                replaced.managed.requires_grad_(face.requires_grad)
            for slot in slots:
                slot.face = face
                slot.module._parameters[slot.name] = face
            if mode != "apply" and not problem:
                replaced.managed.grad = None  # the gradient of values that are gone
            changed = True
        if changed:
            self.mirror_gradients()
        if problems and refuse:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            fix = ("convert the model before fully_shard, or compute in another dtype with MixedPrecisionPolicy"
                   if mode == "apply" else
                   "set a DTensor laid out as the parameter (distribute_tensor(value, p.device_mesh, p.placements)), "
                   "or load values with load_state_dict (assign=False copies and casts them into the shards)")
            raise ValueError(
                f"{caller}: the runtime computes with its own shards, so a change to a sharded parameter it cannot "
                f"follow is refused and undone: {'; '.join(problems[:3])}{more}. Fix: {fix} "
                "(docs/python.md, 'Parameters replaced after fully_shard')")

    def forward_settings(self) -> None:
        """What the user changed since the last step: parameters replaced (take_replacements),
        gradients dropped (zero_grad), requires_grad."""
        self.take_replacements("fsdpcpp: a sharded module's forward")
        self.release_dropped_gradients()
        for slot in self.slots:
            if slot.managed.requires_grad != slot.face.requires_grad:
                slot.managed.requires_grad_(slot.face.requires_grad)


def _replacement_problem(slot: _Slot, source, mode: str) -> str | None:
    """Why `source`, found in the slot, cannot become the slot's parameter (None: it can)."""
    full_shape = list(slot.spec.shape) if slot.spec is not None else list(slot.managed.shape)
    if not isinstance(source, torch.Tensor):
        return ("was removed from its module (del, register_parameter(name, None), nn.utils.parametrize: register "
                "parametrizations before fully_shard)")
    if managed(source) is not source and managed(source) is not slot.managed:
        return ("was replaced by another sharded parameter (tie weights before fully_shard, and shard the modules "
                "that share one in one fully_shard call)")
    if list(source.shape) != full_shape:
        return f"was replaced by a tensor of shape {list(source.shape)}, not {full_shape}"
    if source.dtype != slot.managed.dtype:
        return f"became {source.dtype}; the shards are {slot.managed.dtype}"
    if mode == "apply":
        if source.device.type != slot.managed.device.type:
            return f"moved to {source.device}; the shards are on {slot.managed.device}"
        return None
    if source.is_meta:
        return "was replaced by a tensor on meta, which holds no values"
    if mode == "set" and slot.spec is not None and not isinstance(source, DTensor):
        return "was replaced by a plain tensor, which whoever holds it could not step"
    return None


def copy_my_rows(source: torch.Tensor, target: torch.Tensor, spec: DTensorSpec | None) -> None:
    """Copies this rank's rows of `source` (a full tensor, or a DTensor of any layout) into the
    managed tensor `target`, whose face has `spec` (None: it has none, and is whole)."""
    if spec is None:
        target.copy_(source.full_tensor() if isinstance(source, DTensor) else source)
        return
    first_row, rows, _ = _C.shard_rows(target)
    if isinstance(source, DTensor) and source.placements == spec.placements and source._local_tensor.shape[0] == rows:
        local = source._local_tensor
    else:
        full = source.full_tensor() if isinstance(source, DTensor) else source
        local = _tp_part(full, tp_spec_of(target)).narrow(0, first_row, rows)
    if rows > 0:
        target.narrow(0, 0, rows).copy_(local)


def tp_spec_of(managed_tensor: torch.Tensor) -> DTensorSpec | None:
    """The layout on the tp mesh of a managed parameter tensor parallelism split (None: not split)."""
    return managed_tensor.__dict__.get("_fsdpcpp_tp_spec")


def refuse_tp_parts(named, caller: str, instead: str) -> None:
    """fsdp.cpp's own whole-model calls reach the ranks of one dp mesh, not a tp part's peers."""
    for name, tensor in named:
        if tp_spec_of(tensor) is not None:
            raise NotImplementedError(f"{caller}: '{name}' is split by tensor parallelism, which this call does not "
                                      f"follow: use {instead}, as with FSDP2")


def _tp_part(full: torch.Tensor, tp_spec: DTensorSpec | None) -> torch.Tensor:
    """This rank's tp part of a full tensor: its chunk along a Shard placement's dim (torch.chunk,
    as DTensor's Shard), the whole where it is replicated."""
    if tp_spec is None:
        return full
    (placement,) = tp_spec.placements
    if isinstance(placement, Shard):
        return full.chunk(tp_spec.mesh.size(), dim=placement.dim)[tp_spec.mesh.get_local_rank()]
    return full


def take_tp_parts(modules, params, caller: str) -> list:
    """`params` (name, tensor) with each DTensor that torch's tensor parallelism made (on the tp
    mesh) replaced, in every slot of `modules` that holds it, by a plain parameter of its local
    part: what the runtime manages, sharded over the dp ranks. Refuses, naming the parameter, a
    DTensor on another mesh than the tp ranks of this rank's dp mesh, or placed otherwise than
    Shard or Replicate, or split unevenly."""
    parts, out = {}, []
    for name, param in params:
        if isinstance(param, DTensor) and tp_spec_of(param) is None and id(param) not in parts:
            parts[id(param)] = _tp_part_of(param, name, caller)
        out.append((name, parts.get(id(param), param)))
    if parts:
        for module in modules:
            for sub in module.modules():
                for slot, value in sub._parameters.items():
                    if value is not None and id(value) in parts:
                        sub._parameters[slot] = parts[id(value)]
    return out


def _tp_part_of(param: DTensor, name: str, caller: str) -> nn.Parameter:
    spec = param._spec
    tp_ranks = [rank() // _tp * _tp + t for t in range(_tp)]
    problem = None
    if _tp == 1:
        problem = ("is a DTensor, but the mesh fully_shard shards over is every rank: pass the dp dims of the mesh "
                   "its tensor parallelism used (mesh['dp'])")
    elif spec.mesh.ndim != 1 or spec.mesh.mesh.tolist() != tp_ranks:
        problem = (f"is a DTensor on ranks {spec.mesh.mesh.tolist()}, not this rank's tp ranks {tp_ranks} (the last dim "
                   "of the mesh whose dp dims fully_shard shards over)")
    elif not isinstance(spec.placements[0], (Shard, Replicate)) or isinstance(spec.placements[0], _StridedShard):
        problem = f"is placed {spec.placements[0]!r} on the tp mesh; Shard or Replicate is supported"
    elif isinstance(spec.placements[0], Shard) and spec.shape[spec.placements[0].dim] % _tp:
        problem = (f"has {spec.shape[spec.placements[0].dim]} entries along its tp dim {spec.placements[0].dim}, not "
                   f"divisible by the {_tp} tp ranks")
    if problem:
        raise NotImplementedError(f"{caller}: parameter '{name}' {problem}")
    part = nn.Parameter(param._local_tensor.detach(), requires_grad=param.requires_grad)
    part.__dict__.update(param.__dict__)
    part._fsdpcpp_tp_spec = spec
    part._fsdpcpp_tp_original = param  # becomes its face (make_faces), so whoever holds it holds the face
    return part


def _face_spec(param: torch.Tensor) -> DTensorSpec:
    """FSDP2's layout of a sharded parameter: Shard(0) over the dp mesh (HSDP: Replicate() over its
    replicas first); with tensor parallelism, over the dp mesh and then the tp mesh, the tp
    placement last and the dp one a _StridedShard(0) where the tp one splits dim 0 too."""
    mesh, tp_spec = default_mesh(), tp_spec_of(param)
    replicas = (Replicate(),) if mesh.ndim == 2 else ()
    if tp_spec is None:
        _, _, full_shape = _C.shard_rows(param)
        meta = TensorMeta(torch.Size(full_shape), make_contiguous_strides_for(full_shape), param.dtype)
        return DTensorSpec(mesh, (*replicas, Shard(0)), meta)
    key = (mesh, tp_spec.mesh)
    if key not in _spmd_meshes:
        from torch.distributed.device_mesh import DeviceMesh
        _spmd_meshes[key] = DeviceMesh._concatenate([mesh, tp_spec.mesh])
    split = tp_spec.num_shards_map[0]
    dp_placement = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    return DTensorSpec(_spmd_meshes[key], (*replicas, dp_placement, *tp_spec.placements),
                       tp_spec.tensor_meta)


def _face(param: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> nn.Parameter:
    local = param.detach()
    face = nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=requires_grad)
    face._fsdpcpp_managed = param
    param._fsdpcpp_face_local = face._local_tensor  # what an untouched face holds (_Slot.holds_its_face)
    return face


def make_faces(modules, params, inner_modules) -> _Faces:
    """Registers a face for each of `params` (the group's managed (name, tensor) pairs) in every
    slot of the trees of `modules` (the group's: one, or a fully_shard list) outside the inner
    sharded modules that holds it; each module that holds one takes replacements after
    load_state_dict (_Faces.take_replacements)."""
    inner = {id(m) for sub in inner_modules for m in sub.modules()}
    faces = {}
    for _, param in params:
        if param.dim() == 0:
            faces[id(param)] = (param, None)  # no rows to shard by (the runtime keeps it whole): no face
            continue
        spec = _face_spec(param)
        face = _face(param, spec, param.requires_grad)
        original = param.__dict__.pop("_fsdpcpp_tp_original", None)
        if original is not None:  # the DTensor tensor parallelism made becomes the face, its identity kept
            torch.utils.swap_tensors(original, face)
            face = original
        faces[id(param)] = (face, spec)
    slots = []
    for sub in dict.fromkeys(sub for module in modules for sub in module.modules()):
        if id(sub) in inner:
            continue
        for name, value in sub._parameters.items():
            if value is not None and id(value) in faces:
                slots.append(_Slot(sub, name, value, *faces[id(value)]))
    state = _Faces(slots, modules, list({id(f): f for sub in inner_modules for f in sub._fsdpcpp.faces.under()}.values()))
    state.use_faces()
    for sub in dict.fromkeys(slot.module for slot in slots):
        sub.register_load_state_dict_post_hook(
            lambda module, incompatible, state=weakref.ref(state): _after_load(state()))
    _live_faces.add(state)
    return state


def _after_load(state) -> None:
    if state is not None:
        state.take_replacements("fsdpcpp: load_state_dict", mode="load")


def take_replacements_in(model: nn.Module, caller: str) -> None:
    """take_replacements for every sharded module in `model` (before a whole-model view reads its
    shards)."""
    faces = {id(m._fsdpcpp.faces): m._fsdpcpp.faces for m in model.modules() if hasattr(m, "_fsdpcpp")}
    for state in faces.values():
        state.take_replacements(caller)


def enter_forward(faces: _Faces) -> None:
    global _forward_depth
    if outermost():  # a step's first forward (of this module's tree), not a recompute in backward
        for state in faces.under():
            state.forward_settings()
    _forward_depth += 1


def exit_forward(faces: _Faces, outputs) -> None:
    """After a module's forward (or its abort): its faces back. When its outputs' gradients arrive
    in backward, the managed tensors are put back in for the backward (a recompute of the forward
    that torch.utils.checkpoint runs inside the module's hooks reads them from the module); the end
    of backward restores every face. Under the outermost forward, that end also mirrors every
    module's gradients, once the runtime has committed them."""
    global _forward_depth
    _forward_depth -= 1
    faces.use_faces()
    if not torch.is_grad_enabled():
        return
    differentiable = [t for t in outputs if t.requires_grad]
    for t in differentiable:
        t.register_hook(faces.use_managed_in_backward)
    if _forward_depth == 0:
        for t in differentiable:
            t.register_hook(_queue_mirror)


def _queue_mirror(grad):
    # Runs in backward after the runtime's own hooks on the same outputs (registered first), so the
    # runtime's end-of-backward callback is already queued and this one runs after it.
    global _mirror_queued
    if not _mirror_queued:
        _mirror_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)
    return grad


def _end_of_backward() -> None:
    global _mirror_queued
    _mirror_queued = False
    for state in list(_live_faces):
        state.use_faces()
        state.mirror_gradients()
    for state in list(_live_faces):
        state.run_post_accumulate_grad_hooks()  # those the runtime did not call in backward
        state.hooks_ran = False
