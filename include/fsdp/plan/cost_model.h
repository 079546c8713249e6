// What one training step of a sharded model costs, group by group: the input of the
// schedule simulator and the planner. Plain numbers, no torch: measured on a real step, or
// written by hand in tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/group_memory.h"

namespace fsdp::plan {

/// One parameter group (one fully_shard call), in forward order. Memory is in bytes of the
/// caching allocator's "allocated" count; times in milliseconds.
struct GroupCost {
  std::string name;  ///< the group's module path ("blocks.3")
  GroupMemory memory;  ///< its buffers (GroupParams's sizes)
  double allgather_ms = 0;         ///< the all-gather's time alone
  double reduce_scatter_ms = 0;    ///< the reduce-scatter's time alone
  /// Above the level at the start of its forward: the most in use during the forward.
  int64_t forward_peak_bytes = 0;
  int64_t saved_bytes = 0;  ///< what stays allocated after the forward until its backward
  int64_t recompute_saved_bytes = 0;  ///< the same when the group is recomputed (recomputed)
  /// Above the level at the start of its backward (after a recompute): the most in use during it.
  int64_t backward_peak_bytes = 0;
  double forward_ms = 0;       ///< device time of the forward; a recompute costs it again
  double backward_ms = 0;      ///< device time of the backward
  /// Device time of the tensor-parallel collectives of one forward, on the compute stream: the
  /// backward makes as many, a recompute repeats them (a projection to tp > 1 sets it).
  double tp_comm_ms = 0;
  double forward_cpu_ms = 0;   ///< host time to issue the forward (CPU-bound models)
  double backward_cpu_ms = 0;  ///< host time to issue the backward
  /// Device time of the copy of its gradients into the reduce-scatter input (with the unsynced
  /// sums added, when earlier passes held them), on the compute stream before the reduce-scatter.
  double handoff_ms = 0;
  double handoff_cpu_ms = 0;  ///< host time to issue it
  bool recomputable = true;  ///< whether the model can recompute this group in backward
  /// The root (only the first group may be one): its forward wraps every later group's. Its
  /// parameters are gathered first; its own compute (a model's head) runs after the others'
  /// forward and its own backward before theirs; its gradients are reduce-scattered last.
  bool encloses_later = false;
};

/// How collectives and compute slow each other when they run side by side (NCCL's kernels take SMs
/// and memory bandwidth): measured from a step at prefetch depth 1 (plan/measured_step.h). The
/// defaults mean no contention.
struct Contention {
  double allgather_stretch = 1;       ///< an all-gather's time beside compute / alone
  double reduce_scatter_stretch = 1;  ///< a reduce-scatter's time beside compute / alone
  double compute_slowdown = 0;  ///< compute time added per ms of collective running beside it
};

/// What a step of a model costs: per group, the contention between collectives and compute, and
/// what lies outside the groups.
struct CostModel {
  std::vector<GroupCost> groups;  ///< in forward order, the root first
  Contention contention;          ///< measured by plan::calibrate_contention; default none
  /// Forward and backward passes per optimizer step (gradient accumulation).
  int micro_batches = 1;
  /// true: every pass reduce-scatters; the first allocates the sharded gradients, later ones add
  /// into them through a reduce-scatter output freed at the pass's end. false: the passes before
  /// the last hold unsharded sums (unsynced_grad_bytes) and only the last reduce-scatters.
  bool reduce_every_micro_batch = true;
  /// What a collective costs whatever its size (launch and synchronisation across the ranks):
  /// one coalesced collective of k groups (a bucket) takes k - 1 of them less than k apart.
  /// Measured with the profile from the smallest collectives back to back; 0: buckets save nothing.
  double allgather_latency_ms = 0;
  double reduce_scatter_latency_ms = 0;  ///< the same for reduce-scatters
  int64_t fixed_bytes = 0;  ///< allocated when the step starts: shards, optimizer state, workspaces
  double fixed_ms = 0;      ///< time outside the groups (optimizer step, launch gaps)
  int64_t profiled_peak_bytes = 0;  ///< measured: the peak of the step this model was profiled from
  double profiled_step_ms = 0;      ///< and its time
};

}  // namespace fsdp::plan
