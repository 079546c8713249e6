// Replays one step of a schedule on a cost model and predicts its time and peak memory.
//
// Memory follows the host's order of allocations and frees, as the caching allocator counts
// them: a group's parameters from its all-gather's issue to its reshard (and the all-gather's
// buffers until its compute waits for them), its activations from its forward to the end of its
// backward, its gradients until its reduce-scatter's issue, the reduce-scatter input until a
// later issue finds it done (or the in-flight cap orders the compute stream after it), the
// sharded gradients to the end of the step. A root group (GroupCost::encloses_later) is gathered first,
// computes after the others' forward and before their backward, and is reduced last.
// Time follows three device streams as the runtime orders them: compute; all-gathers and
// reduce-scatters, each starting no earlier than the compute work issued before it (the
// runtime's event wait) and the previous operation of its stream; the host issues work in
// program order, paying each group's CPU time, and past max_inflight_allgathers unreleased
// parameter buffers blocks until the oldest release; past max_inflight_reduce_scatters the compute
// stream waits for the oldest reduce-scatter. Contention (CostModel::contention):
// a prefetched all-gather, and a reduce-scatter that more backward compute follows, take their
// stretch times as long as alone; a compute phase takes compute_slowdown ms longer for every ms
// of collective time that overlaps it.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "fsdp/plan/cost_model.h"
#include "fsdp/plan/schedule.h"

namespace fsdp::plan {

/// A buffer allocated at the predicted peak.
struct LiveBuffer {
  std::string what;  ///< "parameters of blocks.3", "activations of blocks.3", ...
  int64_t bytes = 0;  ///< its size
};

/// What simulate() predicts of a schedule.
struct Prediction {
  double step_ms = 0;  ///< the step's time
  int64_t peak_bytes = 0;                ///< fixed bytes included
  std::string peak_during;               ///< "backward of blocks.3", ...
  std::vector<LiveBuffer> live_at_peak;  ///< largest first, the fixed bytes among them
  std::vector<std::pair<std::string, int64_t>> timeline;  ///< (event, bytes in use after it)
};

/// Throws std::invalid_argument when the schedule's per-group vectors do not match the model.
/// explain = false: only step_ms and peak_bytes (no names, no timeline; the planner's search).
Prediction simulate(const CostModel& model, const Schedule& schedule, bool explain = true);

/// How much of the (start, end) intervals falls within [from, to] (overlaps counted once each).
double time_within(const std::vector<std::pair<double, double>>& intervals, double from, double to);

}  // namespace fsdp::plan
