#include "train/planned_run.h"

#include <algorithm>
#include <cstdio>

#include "fsdp/launch.h"
#include "fsdp/planning.h"
#include "train/cost_model_file.h"
#include "train/plan_reports.h"
#include "train/memory.h"
#include "train/llama_schedule.h"

namespace fsdp::train {

PlannedRun::PlannedRun(const TrainArgs& args, model::Llama& model, const c10::Device& device, int first_step)
    : args_(args),
      model_(model),
      device_(device),
      first_step_(first_step),
      steps_(*model, [&model](const plan::Schedule& schedule) { apply_schedule(model, schedule); }, args.grad_accum,
             args.grad_accum_sync == "every") {}

PlannedRun::StartRecording PlannedRun::before_step(int step) {
  if (!measuring(step) || !steps_.before_step()) return nullptr;
  return [this] { steps_.start_recording(); };
}

void PlannedRun::after_step(int step, double ms) {
  if (measuring(step)) steps_.after_step(ms);
}

double PlannedRun::peak_allocated_gib(int step, double measured) const {
  if (step != first_step_ + ProfilingSteps::kProfiledStep) return measured;
  return std::max(measured, steps_.profile().profiled_peak_bytes / double(int64_t(1) << 30));
}

PlannedRun::Next PlannedRun::report_and_plan(int step, const std::function<void()>& one_step, bool lead) {
  if (step == first_step_ + ProfilingSteps::kProfiledStep && lead)
    std::printf("%s", profile_report(steps_.profile(), profiling_schedule(*model_)).c_str());
  if (step != first_step_after() - 1) return Next::Train;
  const plan::CostModel& profile = steps_.profile();
  if (lead) std::printf("%s", contention_report(profile, calibration_schedule(*model_)).c_str());
  if (lead && !args_.cost_model.empty()) {
    const int world = launch_env_from_process().world_size;  // one shard group (planning refuses --replicas)
    const int64_t tokens = int64_t(args_.batch) * args_.seq / args_.tp;  // --batch is a tp group's
    write_cost_model(args_.cost_model, {{profile, world, sharded_fixed_bytes(args_, world)}, tokens, args_.tp});
    std::printf("fsdp-train: cost model written to %s (fsdp-train --project reads it)\n", args_.cost_model.c_str());
  }
  if (!args_.plan_check.empty()) {
    const PlanCheck check{args_.plan_check_budgets, args_.plan_check_steps, args_.plan_check_rounds,
                          smallest_gpu_bytes(), args_.plan_check};
    check_plans(model_, profile, one_step, device_, check, lead);
    if (lead) std::printf("fsdp-train: plan check written to %s\n", args_.plan_check.c_str());
    return Next::Stop;
  }
  const auto budget = static_cast<int64_t>(args_.memory_budget_gib * double(int64_t(1) << 30));
  plan::Plan plan;
  try {
    plan = plan_for_budget(*model_, budget, profile);
  } catch (const plan::BudgetTooSmall& e) {
    if (lead)
      std::fprintf(stderr, "fsdp-train: error: --memory-budget: %s%s\n", e.what(),
                   args_.cpu_offload || !device_.is_cuda() ? "" : " (--cpu-offload moves the sharded state to the host)");
    return Next::BudgetRefused;
  }
  if (lead) std::printf("%s", plan_report(plan, profile, budget).c_str());
  if (args_.plan_only) return Next::Stop;
  apply_schedule(model_, plan.chosen.schedule);
  return Next::Train;
}

}  // namespace fsdp::train
