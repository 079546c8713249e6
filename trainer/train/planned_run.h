// --memory-budget and --plan-check inside a training run: the planner's steps as one object the
// training loop calls before and after each step, instead of step-number sentinels in the loop.
//
// After the run's first step (which records the execution order, every block recomputed so that
// it fits where training can): two steps under the profiling schedule (a warm-up timed untraced,
// then the profiled step), two at prefetch depth 1 (a warm-up, where the allocator grows its pool,
// then the step that calibrates the contention between collectives and compute); then the plan
// for the budget is made and applied (--memory-budget), printed (--plan-only), or each budget's
// plan is trained and measured against its prediction (--plan-check). The fits take the
// warm-ups' untraced times: recording costs host time.
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <optional>

#include "fsdp/plan/cost_model.h"
#include "model/llama.h"
#include "train/args.h"

namespace fsdp::train {

class PlannedRun {
 public:
  // `first_step`: the run's first step (a resumed run's too); `device`: where the ranks compute.
  PlannedRun(const TrainArgs& args, model::Llama& model, const c10::Device& device, int first_step);

  // The first step after the planner's (where a trace of the planned schedule may start).
  int first_step_after() const { return calibration_step_ + 1; }
  // Before `step`: the schedule it runs under where a phase starts; returns the recording to start
  // on the step's last micro-batch (fsdp::start_profiled_step or start_calibration_step), or null.
  using StartRecording = void (*)();
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
  const TrainArgs& args_;
  model::Llama& model_;
  c10::Device device_;
  int profiling_warmup_step_, profiled_step_, calibration_warmup_step_, calibration_step_;
  double warmup_ms_ = 0;  // the last warm-up step's time
  std::optional<plan::CostModel> profile_;
};

}  // namespace fsdp::train
