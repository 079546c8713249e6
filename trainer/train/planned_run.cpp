#include "train/planned_run.h"

#include <algorithm>
#include <cstdio>

#include "fsdp/planning.h"
#include "train/plan_reports.h"
#include "train/memory.h"
#include "train/llama_schedule.h"

namespace fsdp::train {

PlannedRun::PlannedRun(const TrainArgs& args, model::Llama& model, const c10::Device& device, int first_step)
    : args_(args),
      model_(model),
      device_(device),
      profiling_warmup_step_(first_step + 1),
      profiled_step_(first_step + 2),
      calibration_warmup_step_(first_step + 3),
      calibration_step_(first_step + 4) {}

PlannedRun::StartRecording PlannedRun::before_step(int step) {
  if (step == profiling_warmup_step_) apply_schedule(model_, profiling_schedule(*model_));
  if (step == calibration_warmup_step_) apply_schedule(model_, calibration_schedule(*model_));
  if (step == profiled_step_) return start_profiled_step;
  if (step == calibration_step_) return start_calibration_step;
  return nullptr;
}

void PlannedRun::after_step(int step, double ms) {
  if (step == profiling_warmup_step_ || step == calibration_warmup_step_) warmup_ms_ = ms;
  if (step == profiled_step_)
    profile_ = finish_profiled_step(*model_, warmup_ms_, args_.grad_accum, args_.grad_accum_sync == "every");
  if (step == calibration_step_) finish_calibration_step(*model_, *profile_, warmup_ms_);
}

double PlannedRun::peak_allocated_gib(int step, double measured) const {
  if (step != profiled_step_) return measured;
  return std::max(measured, profile_->profiled_peak_bytes / double(int64_t(1) << 30));
}

PlannedRun::Next PlannedRun::report_and_plan(int step, const std::function<void()>& one_step, bool lead) {
  if (step == profiled_step_ && lead) std::printf("%s", profile_report(*profile_, profiling_schedule(*model_)).c_str());
  if (step != calibration_step_) return Next::Train;
  if (lead) std::printf("%s", contention_report(*profile_, calibration_schedule(*model_)).c_str());
  if (!args_.plan_check.empty()) {
    const PlanCheck check{args_.plan_check_budgets, args_.plan_check_steps, args_.plan_check_rounds,
                          smallest_gpu_bytes(), args_.plan_check};
    check_plans(model_, *profile_, one_step, device_, check, lead);
    if (lead) std::printf("fsdp-train: plan check written to %s\n", args_.plan_check.c_str());
    return Next::Stop;
  }
  const auto budget = static_cast<int64_t>(args_.memory_budget_gib * double(int64_t(1) << 30));
  plan::Plan plan;
  try {
    plan = plan_for_budget(*model_, budget, *profile_);
  } catch (const plan::BudgetTooSmall& e) {
    if (lead)
      std::fprintf(stderr, "fsdp-train: error: --memory-budget: %s%s\n", e.what(),
                   args_.cpu_offload || !device_.is_cuda() ? "" : " (--cpu-offload moves the sharded state to the host)");
    return Next::BudgetRefused;
  }
  if (lead) std::printf("%s", plan_report(plan, *profile_, budget).c_str());
  if (args_.plan_only) return Next::Stop;
  apply_schedule(model_, plan.chosen.schedule);
  return Next::Train;
}

}  // namespace fsdp::train
