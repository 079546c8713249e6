// fsdp-train's --memory-budget, --plan-only and --plan-check: what it prints of a plan, and the
// planner's benchmark (predicted against measured, schedule by schedule, in one process).
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <string>

#include "fsdp/plan/planner.h"
#include "model/llama.h"

namespace fsdp::train {

// The profiled step, measured and as the simulator replays it (its own check).
std::string profile_report(const plan::CostModel& profile, const plan::Schedule& profiled);
// The calibration step: the contention measured, its replay with and without it.
std::string contention_report(const plan::CostModel& profile, const plan::Schedule& calibrated);
// The chosen schedule, its predicted time and peak, what is live at the peak, the runners-up.
std::string plan_report(const plan::Plan& plan, const plan::CostModel& profile, int64_t budget_bytes);

// --plan-check: the schedules of no and of full checkpointing (the runtime's defaults otherwise)
// and the planner's choice for `budgets` budgets spread evenly from the predicted peak of the one
// to the other's, and no checkpointing with each of plan::bucket_sizes_mb. Each distinct one is
// applied and trained for `steps` steps (`one_step` runs a step; the first two are warm-up) in
// each of `rounds` rounds (alternately in order and reversed), and rank 0 writes one JSON line
// each to `path`: the schedule, its predicted and its measured step time (median of all rounds'
// steps, and each round's) and peak allocated bytes. Schedules predicted above `device_bytes`
// (when positive) are not run.
struct PlanCheck {
  int budgets = 8, steps = 6, rounds = 2;
  double device_bytes = 0;
  std::string path;
};
void check_plans(model::Llama& model, const plan::CostModel& profile, const std::function<void()>& one_step,
                 const c10::Device& device, const PlanCheck& check, bool lead);

}  // namespace fsdp::train
