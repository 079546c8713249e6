// What the planner chooses for a model's step: per group, recomputed or not, kept unsharded or
// not, its prefetch depth, and the runtime's options. Plain data, no torch.
#pragma once

#include <cstddef>
#include <vector>

#include "fsdp/runtime_options.h"

namespace fsdp::plan {

/// The choices a schedule makes, per group and for the runtime (RuntimeOptions' meanings).
struct Schedule {
  std::vector<bool> recompute;             ///< recompute the group's activations in backward
  std::vector<bool> reshard_after_forward;  ///< free its parameters between forward and backward
  /// Groups all-gathered ahead at the group's start (pre-forward, pre-backward): deeper before a
  /// group whose compute is short beside the next gathers. -1, or an empty vector for all:
  /// runtime.prefetch_depth.
  std::vector<int> prefetch_depth;
  /// The runtime's knobs under this schedule: prefetch depth, in-flight caps, buckets (groups
  /// below bucket_mb share coalesced collectives: membership follows from the sizes and the order).
  RuntimeOptions runtime;

  /// Group g's prefetch depth under this schedule.
  int prefetch_depth_of(size_t g) const {
    return g < prefetch_depth.size() && prefetch_depth[g] >= 0 ? prefetch_depth[g] : runtime.prefetch_depth;
  }
  /// The same choices everywhere.
  bool operator==(const Schedule& o) const {
    return recompute == o.recompute && reshard_after_forward == o.reshard_after_forward &&
           prefetch_depth == o.prefetch_depth && runtime == o.runtime;
  }
};

/// The runtime's defaults for `groups` groups: every group resharded, none recomputed.
Schedule default_schedule(size_t groups);

/// The runtime's defaults with every recomputable group recomputed (or none), and every group
/// resharded but the one enclosing the others (kept for its backward anyway). `Group` is
/// GroupShape or GroupCost: both say `recomputable` and `encloses_later`.
template <class Group>
Schedule uniform_schedule(const std::vector<Group>& groups, bool recomputed) {
  Schedule s = default_schedule(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    s.recompute[g] = recomputed && groups[g].recomputable;
    s.reshard_after_forward[g] = !groups[g].encloses_later;
  }
  return s;
}

}  // namespace fsdp::plan
