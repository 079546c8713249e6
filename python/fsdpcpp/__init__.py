"""fsdpcpp: fully sharded data parallel training for PyTorch modules, run by fsdp.cpp's C++ runtime.

A drop-in for FSDP2's ``fully_shard``: change the import, keep the model.

    import fsdpcpp
    from fsdpcpp import fully_shard, MixedPrecisionPolicy

    fsdpcpp.init()                       # from torchrun's or mpirun's variables
    for block in model.layers:
        fully_shard(block)               # bottom-up: each block, then the root
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())   # before or after sharding: the same
    loss = model(tokens).loss            # forward hooks gather and free the parameters
    loss.backward()                      # gradients reduce-scattered into the shards
    fsdpcpp.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

See docs/python.md for what is the same as FSDP2, what differs, and what is not supported.
"""

from ._runtime import (
    init,
    is_initialized,
    rank,
    world_size,
    device,
    shutdown,
    runtime_options,
    set_runtime_options,
    runtime_stats,
    all_reduce,
    allocated_bytes,
    reset_peak_allocated,
    start_trace,
    write_trace,
)
from ._fully_shard import (
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    CPUOffloadPolicy,
    fully_shard,
    set_recomputed,
    is_recomputed,
    use_as_fsdp2,
)
from ._state import clip_grad_norm_, get_model_state_dict, set_model_state_dict, full_parameter
from ._checkpoint import save_checkpoint, load_checkpoint, newest_checkpoint, checkpoint_name
from ._planner import BudgetTooSmall, Plan, plan_memory_budget

__version__ = _runtime.version()

__all__ = [
    "init", "is_initialized", "rank", "world_size", "device", "shutdown",
    "runtime_options", "set_runtime_options", "runtime_stats", "all_reduce",
    "allocated_bytes", "reset_peak_allocated", "start_trace", "write_trace",
    "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "fully_shard",
    "set_recomputed", "is_recomputed", "use_as_fsdp2",
    "clip_grad_norm_", "get_model_state_dict", "set_model_state_dict", "full_parameter",
    "save_checkpoint", "load_checkpoint", "newest_checkpoint", "checkpoint_name",
    "plan_memory_budget", "Plan", "BudgetTooSmall",
]
