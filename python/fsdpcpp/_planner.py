"""The memory-budget planner from Python (docs/planner.md): profile the user's own training step,
plan the fastest schedule whose predicted peak fits a budget, and apply it, per-module
recomputation included. The measuring steps (fsdp::ProfilingSteps, the same fsdp-train takes), the
cost model, the search and the per-group and runtime choices are the C++ library's
(fsdp/planning.h); this file trains its steps, recomputes the modules a schedule names, and puts
the model back where a plan fails or is not applied."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import _C, _dtensor
from ._fully_shard import FSDPModule, is_recomputed, set_recomputed
from ._runtime import _fields, device, rank


class BudgetTooSmall(ValueError):
    """No schedule fits the budget; smallest_budget_bytes (margin included) would."""

    def __init__(self, message: str, smallest_budget_bytes: int):
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes


@dataclass(frozen=True)
class Plan:
    """The schedule plan_memory_budget chose, and what the planner predicts of it."""

    budget_bytes: int
    step_ms: float  # the predicted time of a step
    peak_bytes: int  # the predicted peak allocated, the fixed bytes (shards, optimizer state) included
    recomputed: list[str]  # module paths recomputed in backward
    kept_unsharded: list[str]  # module paths whose parameters stay gathered from forward to backward
    prefetch_depths: dict  # module path -> its own prefetch depth, where it differs from runtime_options'
    runtime_options: dict  # the schedule's scheduling options (applied as the root's own; its max_pending_host_steps kept)
    description: str  # the planner's one line for the schedule
    profiled_step_ms: float  # the profiled step (every module recomputed, no prefetch)
    profiled_peak_bytes: int

    def __str__(self) -> str:
        fmt = _C.format_bytes
        return (f"plan for {fmt(self.budget_bytes)}: {self.description}; predicted {self.step_ms:.1f} ms a step, "
                f"peak {fmt(self.peak_bytes)} (profiled: {self.profiled_step_ms:.1f} ms, "
                f"peak {fmt(self.profiled_peak_bytes)})")


class _Root:
    """The sharded root as the library's planning calls take it: its groups named by module path."""

    def __init__(self, model: nn.Module):
        if not isinstance(model, FSDPModule):
            raise ValueError(f"fsdpcpp.plan_memory_budget({type(model).__name__}): the model is not sharded; "
                             "fully_shard its blocks and then the model itself (the root), then plan")
        self.name = model._fsdpcpp.module_class.__name__  # the user's class, not fully_shard's mixin
        self.modules = {path or "root": m for path, m in model.named_modules() if isinstance(m, FSDPModule)}
        grouped = [path for path, m in self.modules.items() if m._fsdpcpp.module_list is not None]
        if grouped:
            raise NotImplementedError(f"fsdpcpp.plan_memory_budget({self.name}): '{grouped[0]}' was sharded in a list "
                                      "with other modules (one group); the planner plans one module a group: shard "
                                      "them one by one, or together through their parent")
        self.groups = [(path, m._fsdpcpp.group) for path, m in self.modules.items()]

    def call(self, function, *args):
        return function(self.name, self.groups, *args)

    def apply(self, schedule) -> None:
        """The schedule's per-group and runtime choices, and its recomputation."""
        self.call(_C.set_schedule, schedule)
        for path, recompute in zip(self.call(_C.group_names), schedule.recompute):
            set_recomputed(self.modules[path], recompute)

    def recompute_all_but_the_root(self) -> None:
        for path, module in self.modules.items():
            set_recomputed(module, path != "root")

    def choices(self):
        """What a failed or unapplied plan puts back: each module's recomputation, reshard choice
        and prefetch depth, and the root's scheduling options."""
        return ({path: (is_recomputed(m), m._fsdpcpp.group.reshard_after_forward, m._fsdpcpp.group.prefetch_depth)
                 for path, m in self.modules.items()},
                self.modules["root"]._fsdpcpp.group.runtime_options())

    def restore(self, choices) -> None:
        per_module, runtime = choices
        for path, (recompute, reshard, depth) in per_module.items():
            set_recomputed(self.modules[path], recompute)
            self.modules[path]._fsdpcpp.group.set_reshard_after_forward(reshard)
            self.modules[path]._fsdpcpp.group.set_prefetch_depth(depth)
        self.modules["root"]._fsdpcpp.group.set_runtime_options(runtime)


def _wait_for_device() -> None:
    if device().type == "cuda":
        torch.cuda.synchronize(device())


def _measuring_step(model: nn.Module, train_step, micro_batches: int, start_recording) -> float:
    """One step's wall time in ms, the device idle at both ends (what the fits take: planning.h);
    with `start_recording`, its last forward pass (of micro_batches) is recorded from its start."""
    forwards = 0

    def before_forward(module, args):
        nonlocal forwards
        forwards += 1
        if forwards == micro_batches and start_recording:
            _dtensor.release_dropped_gradients()  # as the forward's own hook will, before the record starts
            start_recording()

    handle = model.register_forward_pre_hook(before_forward, prepend=True)  # before the all-gather
    try:
        _wait_for_device()
        start = time.perf_counter()
        train_step()
        _wait_for_device()
    finally:
        handle.remove()
    if forwards != micro_batches:
        raise ValueError(f"fsdpcpp.plan_memory_budget: train_step ran {forwards} forward passes of the model, "
                         f"micro_batches is {micro_batches}: pass the number of forward passes in one step")
    return (time.perf_counter() - start) * 1e3


def plan_memory_budget(model: nn.Module, train_step: Callable[[], object], budget_bytes: int, *,
                       margin: float = 0.05, micro_batches: int = 1, reduce_every_micro_batch: bool = True,
                       apply: bool = True, verbose: bool = True) -> Plan:
    """Finds the fastest schedule for the sharded `model` whose predicted peak allocated memory
    fits `budget_bytes` less `margin`, and (apply=True) trains under it from the next step: which
    sharded modules are recomputed in backward (their whole call under non-reentrant
    torch.utils.checkpoint), which keep their parameters gathered from forward to backward, and
    the root's prefetch depth, in-flight caps and buckets.

    `train_step()` runs one whole training step of yours (the forward and backward passes, the
    optimizer step, zero_grad); it is called five times, the library's measuring steps
    (fsdp::ProfilingSteps; the planner's steps are training steps: the first records the order of
    the modules, every block recomputed; then a timed and a profiled step with every block
    recomputed and no prefetch, then a timed and a calibration step at prefetch depth 1). With gradient accumulation pass `micro_batches` (forward passes a step)
    and reduce_every_micro_batch=False where set_requires_gradient_sync(False) skips all but the
    last reduce-scatter. Collective: every rank calls it; all ranks plan the same schedule.

    Raises fsdpcpp.BudgetTooSmall (a ValueError naming the smallest budget that fits) when no
    schedule fits; the model then trains as before the call, as it does with apply=False."""
    root = _Root(model)
    if budget_bytes <= 0:
        raise ValueError(f"fsdpcpp.plan_memory_budget({root.name}): budget_bytes is {budget_bytes}; pass the memory "
                         "a GPU may hold in bytes (e.g. 40 << 30)")
    before = root.choices()
    try:
        root.recompute_all_but_the_root()
        steps = root.call(_C.ProfilingSteps, root.apply, micro_batches, reduce_every_micro_batch)
        while not steps.done():
            recorded = steps.before_step()
            steps.after_step(_measuring_step(model, train_step, micro_batches, recorded and steps.start_recording))
        profile = steps.profile()
        planned = root.call(_C.plan_for_budget, int(budget_bytes), profile, float(margin))
        if isinstance(planned, tuple):
            raise BudgetTooSmall(f"fsdpcpp.plan_memory_budget({root.name}): {planned[0]}", planned[1])
        planned = planned.chosen
    except BaseException:
        root.restore(before)
        raise
    schedule, names = planned.schedule, root.call(_C.group_names)
    plan = Plan(budget_bytes=int(budget_bytes), step_ms=planned.prediction.step_ms,
                peak_bytes=planned.prediction.peak_bytes,
                recomputed=[n for n, on in zip(names, schedule.recompute) if on],
                kept_unsharded=[n for n, on in zip(names, schedule.reshard_after_forward) if not on],
                prefetch_depths={n: d for n, d in zip(names, schedule.prefetch_depth)
                                 if d >= 0 and d != schedule.runtime.prefetch_depth},
                runtime_options=_fields(schedule.runtime), description=_C.describe_schedule(schedule, profile),
                profiled_step_ms=profile.profiled_step_ms, profiled_peak_bytes=profile.profiled_peak_bytes)
    if apply:
        root.apply(schedule)
    else:
        root.restore(before)
    if verbose and rank() == 0:
        print(f"fsdpcpp: {plan}{'' if apply else ' (not applied)'}", flush=True)
    return plan
