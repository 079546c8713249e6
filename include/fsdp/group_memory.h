// The bytes of one parameter group's buffers: what the parameter group allocates over a step
// (src/shard/group_params.h computes them), and what the planner's cost model and simulator count
// (plan::GroupShape and plan::GroupCost hold one). Plain numbers, no torch.
#pragma once

#include <cstdint>

namespace fsdp {

/// A parameter group's buffers in bytes, each with the lifetime the runtime gives it.
struct GroupMemory {
  /// Parameters unsharded in the compute dtype (those gathered in float8, enable_float8_all_gather:
  /// one byte each), from the all-gather's issue to the reshard.
  int64_t param_bytes = 0;
  /// The all-gather's input and (two or more parameters) output buffers, from its issue until
  /// the compute waits for it; with CPU offload also the staging copy on the device. None on one
  /// rank: the shards are copied straight into the unsharded parameters.
  int64_t gather_buffer_bytes = 0;
  /// The unsharded gradients autograd leaves (compute dtype), from the group's backward until its
  /// reduce-scatter copies them out.
  int64_t grad_bytes = 0;
  /// The reduce-scatter's input, until the reduce-scatter is done (on one rank it is reduced in
  /// place and then becomes the sharded gradients).
  int64_t reduce_input_bytes = 0;
  /// The sharded gradients, to the end of the step (offloaded: none on the device): the
  /// reduce-scatter's result where they alias it (in the reduce dtype, or kept there), copies in
  /// the parameters' dtype where they are cast to it.
  int64_t sharded_grad_bytes = 0;
  /// Gradient accumulation without communication: the unsharded sums in the reduce dtype, from
  /// the first pass's backward to the last pass's reduce-scatter.
  int64_t unsynced_grad_bytes = 0;
};

}  // namespace fsdp
