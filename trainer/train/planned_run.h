// --memory-budget and --plan-check inside a training run: the planner's steps as one object the
// training loop calls before and after each step, instead of step-number sentinels in the loop.
//
// The run's first five steps are the library's measuring steps (fsdp::ProfilingSteps: the first
// records the execution order, every block recomputed so that it fits where training can; then
// the profile and the calibration, each after a timed warm-up). Then the plan for the budget is
// made and applied (--memory-budget), printed (--plan-only), or each budget's plan is trained
// and measured against its prediction (--plan-check).
#pragma once

#include <c10/core/Device.h>

#include <functional>

#include "fsdp/planning.h"
#include "model/llama.h"
#include "train/args.h"

namespace fsdp::train {

class PlannedRun {
 public:
  // `first_step`: the run's first step (a resumed run's too); `device`: where the ranks compute.
  PlannedRun(const TrainArgs& args, model::Llama& model, const c10::Device& device, int first_step);

  // The first step after the planner's (where a trace of the planned schedule may start).
  int first_step_after() const { return first_step_ + ProfilingSteps::kSteps; }
  // Before `step`: applies the schedule its phase runs under; returns the recording to start on
  // the step's last micro-batch, or null.
  using StartRecording = std::function<void()>;
  StartRecording before_step(int step);
  // After `step` ran and its loss was read (the device is idle); `ms` is its wall time.
  void after_step(int step, double ms);
  // The step's peak allocated GiB: the profiled step's marks restarted the allocator's peak, so
  // its peak is the profile's.
  double peak_allocated_gib(int step, double measured) const;

  // After the step's line is printed: the profile's and the calibration's reports, then the plan.
  // `one_step` trains one step (for --plan-check). Returns what the run does next.
  enum class Next { Train, Stop, BudgetRefused };
  Next report_and_plan(int step, const std::function<void()>& one_step, bool lead);

 private:
  bool measuring(int step) const { return step >= first_step_ && step < first_step_after(); }

  const TrainArgs& args_;
  model::Llama& model_;
  c10::Device device_;
  int first_step_;
  ProfilingSteps steps_;
};

}  // namespace fsdp::train
