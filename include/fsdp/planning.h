// The planner's public header: planning a schedule under a GPU memory budget (docs/planner.md,
// "How the planner works"): profile one step, let the planner choose, apply its choice. Its
// plain-data parts (cost model, schedule, simulator, planner, projection) are in fsdp/plan/,
// included here; torch-free code may include a part alone.
//
//   auto apply = [&](const fsdp::plan::Schedule& s) {
//     fsdp::set_schedule(model, s);                  // and recompute the groups s.recompute marks
//   };
//   fsdp::ProfilingSteps steps(*model, apply);
//   while (!steps.done()) {                          // five training steps
//     const bool recorded = steps.before_step();
//     double ms = train_one_step(recorded);          // recorded: steps.start_recording() right
//     steps.after_step(ms);                          // before its last forward; ms: device idle
//   }                                                // at both ends
//   auto plan = fsdp::plan_for_budget(model, 40LL << 30, steps.profile());  // 40 GiB
//   apply(plan.chosen.schedule);
//
// The runtime applies the per-group and runtime choices of a schedule; which groups are
// recomputed in backward is the model's to do (fsdp::recompute), as the schedule's recompute
// vector says. Each call takes the root as a PlanningRoot: a torch::nn model converts to one; the
// Python package (fsdpcpp.plan_memory_budget) lists its nn.Module's groups itself.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/fully_shard.h"
#include "fsdp/plan/measured_step.h"
#include "fsdp/plan/planner.h"
#include "fsdp/plan/projection.h"
#include "fsdp/plan/schedule.h"

namespace fsdp {

/// The sharded groups of one root, each under the name plans and reports give it: its
/// module's path ("blocks.3"; the root's own group "root").
struct PlanningRoot {
  /// The groups of `root`'s modules, found by their paths (implicit, so that a model passes as is).
  PlanningRoot(const torch::nn::Module& root);  // NOLINT(google-explicit-constructor)
  /// A front end's own listing: `name` is how errors name the root.
  PlanningRoot(std::string name, std::vector<std::pair<std::string, GroupState*>> groups)
      : name(std::move(name)), groups(std::move(groups)) {}

  std::string name;  ///< how errors name the root (a torch::nn model: its name())
  std::vector<std::pair<std::string, GroupState*>> groups;  ///< the root's own group among them
};

/// The sharded groups under `root` in the forward order recorded by the last step (so at least
/// one step must have run), with their buffers' sizes. The root group is marked as enclosing the
/// others and not recomputable; every other group recomputable (change it where the model
/// cannot recompute a group). Throws std::invalid_argument for groups sharded with replicas
/// (HSDP), which the cost model does not describe.
std::vector<plan::GroupShape> group_shapes(const PlanningRoot& root);

/// The schedule the profiled step runs under: plan::profiling_schedule of group_shapes(root).
plan::Schedule profiling_schedule(const PlanningRoot& root);

/// Each group's reshard_after_forward and own prefetch depth (set_prefetch_depth; -1 where the
/// schedule's prefetch_depth is empty) and the runtime's prefetch depth, in-flight caps and
/// buckets (bucket_mb, reduce_bucket_max_wait), as the schedule says. Takes effect from the next step. Throws
/// std::invalid_argument when the schedule's group count differs from group_shapes(root)'s.
void set_schedule(const PlanningRoot& root, const plan::Schedule& schedule);
/// Only the runtime's part of it, as the root's own options (set_runtime_options(root's group, ...)):
/// prefetch depth, in-flight caps and buckets; the cap on pending host steps stays the root's.
/// Needs no recorded order (for use right after sharding with the schedule's reshard choices).
void set_runtime_choices(const PlanningRoot& root, const plan::Schedule& schedule);

/// Records the next step with memory marks (call right before its forward; not while a Chrome
/// trace is being recorded). Waits for the device first, so that the step is timed alone.
/// finish_profiled_step, after the optimizer step, waits for the device and measures the cost
/// model of the groups under `root`, with their communicator's collective latency (the smallest
/// collectives, timed back to back). Collective: every number is the
/// largest any rank measured, so all ranks plan the same schedule.
///
/// `untraced_step_ms`: the time of a step under the same schedule that was not recorded (the
/// device idle at its start and end), or 0 to use the recorded step's own time. Recording costs
/// the host time (on the 1B ~7 ms a step, an event pair and memory marks per span) that the fits
/// would read as fixed time and contention; the step before a recorded one, under its schedule,
/// is the natural one to time (fsdp-train does). Throws std::invalid_argument when negative.
///
/// `micro_batches`: forward and backward passes per optimizer step (gradient accumulation), each
/// reduce-scattered (`reduce_every_micro_batch`: set_requires_gradient_sync left on) or only the
/// last (false: set_requires_gradient_sync(root, false) before the others). Record only the last
/// pass (start_profiled_step right before its forward; the calibration step the same way) and
/// pass the untraced time of a whole step (required then); the simulator replays every pass.
void start_profiled_step();
plan::CostModel finish_profiled_step(const PlanningRoot& root, double untraced_step_ms = 0,
                                     int micro_batches = 1, bool reduce_every_micro_batch = true);

/// The step after the profiled one, recorded to measure how collectives and compute slow each
/// other (plan::calibrate_contention), so the planner prices prefetching truthfully: run it under
/// calibration_schedule(root) (the profile's, at prefetch depth 1) between start_calibration_step
/// and finish_calibration_step, which writes profile.contention. Collective, like the profile;
/// `untraced_step_ms` as for finish_profiled_step.
plan::Schedule calibration_schedule(const PlanningRoot& root);
void start_calibration_step();
void finish_calibration_step(const PlanningRoot& root, plan::CostModel& profile, double untraced_step_ms = 0);

/// The measuring steps of a plan, as fsdp-train and fsdpcpp.plan_memory_budget both take them:
/// five of the caller's training steps, each between before_step() and after_step():
///   0. records the forward order (under the caller's schedule: every block recomputed fits where
///      training can);
///   1. under profiling_schedule(root), timed (recording costs host time that the fits would read
///      as fixed time and contention, so they take this step's time);
///   2. the same, recorded: the cost model (finish_profiled_step);
///   3. under calibration_schedule(root) (prefetch depth 1), timed; the allocator grows its pool;
///   4. the same, recorded: how collectives and compute slow each other (finish_calibration_step).
/// `apply` puts a schedule in force: set_schedule(root, s) and the model's recomputation of the
/// groups s.recompute marks (the front end's to do). Collective, like the steps it wraps.
class ProfilingSteps {
 public:
  static constexpr int kSteps = 5;         ///< the measuring steps
  static constexpr int kProfiledStep = 2;  ///< the one whose cost model profile() then holds

  /// `micro_batches` and `reduce_every_micro_batch` as for finish_profiled_step.
  ProfilingSteps(PlanningRoot root, std::function<void(const plan::Schedule&)> apply, int micro_batches = 1,
                 bool reduce_every_micro_batch = true);
  /// Before the next step: applies the schedule its phase starts with; true where the step is
  /// recorded: call start_recording() right before the forward of its last micro-batch.
  bool before_step();
  /// start_profiled_step or start_calibration_step, as the step is.
  void start_recording() const;
  /// After the step: its wall time in ms, the device idle at its start and end.
  void after_step(double ms);
  /// The step before_step() comes to next, 0 to kSteps (all done).
  int next_step() const { return next_; }
  /// Whether all kSteps ran.
  bool done() const { return next_ == kSteps; }
  /// The cost model: measured after step 2, calibrated after step 4. Throws std::logic_error before.
  const plan::CostModel& profile() const;

 private:
  PlanningRoot root_;
  std::function<void(const plan::Schedule&)> apply_;
  int micro_batches_;
  bool reduce_every_micro_batch_;
  int next_ = 0;
  double untraced_ms_ = 0;  // the last timed step's
  std::optional<plan::CostModel> profile_;
};

/// The fastest schedule whose predicted peak fits budget_bytes less the margin (plan::plan_schedule),
/// after checking that `profile` is a profile of root's groups. Throws plan::BudgetTooSmall.
plan::Plan plan_for_budget(const PlanningRoot& root, int64_t budget_bytes, const plan::CostModel& profile,
                           double margin = 0.05);

}  // namespace fsdp
