// Picks the fastest schedule whose predicted peak memory fits a budget, by simulating
// every schedule of a search space on the cost model:
//   - recompute the k recomputable groups that free the most activation bytes per millisecond
//     of recompute, for every k from none to all;
//   - keep the last m groups (whose backward comes first) unsharded between forward and backward;
//   - prefetch depth 0-2 and in-flight caps of 1, 2 or unlimited for all-gathers and reduce-scatters;
//   - no buckets, or buckets of bucket_sizes_mb (each with no cap on the reduce-scatters' wait, or
//     a wait of one group).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/plan/cost_model.h"
#include "fsdp/plan/simulator.h"

namespace fsdp::plan {

/// A schedule and the simulator's prediction of it.
struct Planned {
  Schedule schedule;      ///< the choices
  Prediction prediction;  ///< its predicted time and peak
};

/// The planner's answer for a budget.
struct Plan {
  Planned chosen;  ///< the fastest that fits
  std::vector<Planned> runners_up;  ///< the next fastest that fit with other predictions, up to three
  int64_t usable_bytes = 0;         ///< the budget less its margin
};

/// No schedule fits: smallest_budget_bytes is the least budget (margin included) that would.
class BudgetTooSmall : public std::invalid_argument {
 public:
  /// `message` says why and names the smallest budget.
  BudgetTooSmall(const std::string& message, int64_t smallest_budget_bytes)
      : std::invalid_argument(message), smallest_budget_bytes(smallest_budget_bytes) {}
  int64_t smallest_budget_bytes;  ///< margin included
};

/// The fastest schedule whose predicted peak stays within budget_bytes * (1 - margin); equal
/// times go to the lower peak. Throws BudgetTooSmall naming the smallest budget that fits.
Plan plan_schedule(const CostModel& model, int64_t budget_bytes, double margin = 0.05);

/// The bucket sizes the planner tries: 0 (none), and 2.5 and 4.5 times the smallest group's
/// parameters (about two and four such groups a bucket), when the model has a collective latency
/// that buckets would save.
std::vector<double> bucket_sizes_mb(const CostModel& model);

/// "1.50 GiB", or "12.3 MiB" below a GiB: how plans and their checks print bytes.
std::string format_bytes(int64_t bytes);

/// One line: "recompute 6 of 16 (blocks.0, blocks.1, ...), 2 kept unsharded (...), prefetch 1,
/// in flight 2 all-gathers / 2 reduce-scatters".
std::string describe(const Schedule& schedule, const CostModel& model);

}  // namespace fsdp::plan
