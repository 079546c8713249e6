#pragma once

#include <c10/core/ScalarType.h>

#include <memory>
#include <optional>

namespace fsdp {

class Communicator;

/// Mixed precision: parameters are all-gathered and used for compute in
/// param_dtype, gradients are reduce-scattered in reduce_dtype (default:
/// param_dtype). The sharded master parameters, their gradients and the
/// optimizer state keep the parameters' own dtype (e.g. float32).
struct MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;   ///< all-gather and compute dtype; unset: the parameters'
  std::optional<c10::ScalarType> reduce_dtype;  ///< reduce-scatter dtype; unset: param_dtype
  /// true: the sharded gradients stay in reduce_dtype instead of being cast to the parameters'
  /// dtype (PyTorch FSDP1's MixedPrecision.keep_low_precision_grads): half the gradients' memory
  /// with a bf16 reduce_dtype, and half the bytes an optimizer reads, for an optimizer that takes
  /// gradients of another dtype than its parameters (fsdp-train's AdamW kernel; PyTorch's
  /// optimizers do not). Gradients accumulated over backward passes are then summed in
  /// reduce_dtype. On one rank with no replicas and no CPU offload, a gradient autograd made in
  /// reduce_dtype becomes the sharded gradient with no copy at all.
  bool keep_low_precision_grads = false;
};

/// How fully_shard shards one module. Memory per rank: the group's parameters, gradients and
/// optimizer state divided by comm's size, plus the unsharded parameters while the group runs.
struct ShardOptions {
  /// Communicator to shard over; default: the one fsdp::init() made.
  std::shared_ptr<Communicator> comm;
  /// HSDP (fsdp/mesh.h): the ranks holding the same shard as this one in other replicas (same
  /// device kind as `comm`). After each reduce-scatter over `comm` the sharded gradients are
  /// averaged over them, on a stream of their own. Null: plain FSDP.
  std::shared_ptr<Communicator> replicate;
  /// true: free the unsharded parameters after forward and all-gather them
  /// again for backward (ZeRO-3). false: keep them until the group's backward
  /// (more memory, one all-gather less). The root group always keeps them, as
  /// its backward starts right after forward.
  bool reshard_after_forward = true;
  MixedPrecision mixed_precision;  ///< dtypes of the all-gather, compute and reduce-scatter
  /// CPU offload (as PyTorch FSDP2's CPUOffloadPolicy): the sharded parameters live in pinned host
  /// memory and are copied to the device inside each all-gather; the sharded gradients are copied
  /// back to the host after each reduce-scatter, so an optimizer created after sharding keeps its
  /// state on the host and steps there. GPU memory then holds no shards, gradients or optimizer
  /// state; each step moves the shards in twice and the gradients out once over PCIe. The group's
  /// parameters must share one dtype. On CPU ranks the shards already are in host memory: the
  /// same code paths run, placement does not change.
  bool cpu_offload = false;
  /// Keep each shard's copy in the compute dtype (MixedPrecision::param_dtype) on the device, as
  /// the all-gather sends it: made by the first all-gather after the master shard changes and
  /// sent again until it changes, or written by an optimizer as it steps (compute_shard_of,
  /// mark_compute_shards_written in fsdp/group.h), so no all-gather casts. Costs the shards'
  /// bytes in the compute dtype; where a group is sharded over one rank the unsharded parameters
  /// are that copy, kept across reshards (the group's parameters in the compute dtype, always allocated).
  /// A change of a master shard is seen by its version counter (an in-place op on the parameter
  /// or its shard, a checkpoint load); a write that does not move it, through a raw pointer or by
  /// ATen's fused optimizers (`_fused_adamw_` counts nothing), must bump it
  /// (`unsafeGetTensorImpl()->bump_version()`), as fsdp-train's AdamW does. Not with cpu_offload.
  bool keep_compute_shards = false;
};

}  // namespace fsdp
