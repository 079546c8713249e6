#include "fsdp/planning.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/nn/module.h>

#include <chrono>
#include <stdexcept>
#include <utility>
#include <unordered_map>

#include "fsdp/communicator.h"
#include "fsdp/launch.h"
#include "fsdp/memory_stats.h"
#include "fsdp/runtime_options.h"
#include "fsdp/group.h"
#include "runtime/group_state.h"
#include "runtime/root_state.h"
#include "runtime/runtime.h"
#include "shard/streams.h"
#include "shard/trace.h"

namespace fsdp {
namespace {

struct Group {
  std::string path;  // as PlanningRoot names it: "blocks.3"; "root" for the root's own group
  GroupState* state;
};

std::string root_error(const char* caller, const PlanningRoot& root, const std::string& why) {
  return std::string("fsdp::") + caller + "(" + root.name + "): " + why;
}

// The groups under `root`, in the recorded forward order.
std::vector<Group> groups_in_order(const PlanningRoot& root, const char* caller) {
  std::unordered_map<int, Group> under_root;
  for (const auto& [path, state] : root.groups) under_root.emplace(state->id(), Group{path, state});
  if (under_root.empty())
    throw std::invalid_argument(root_error(caller, root, "no module in it is sharded; call fully_shard first"));
  // The groups' root's record (each root records its own order: runtime/root_state.h).
  const RootState* recorded = under_root.begin()->second.state->root_state();
  std::vector<Group> order;
  for (int id : recorded ? recorded->recorded_forward_order() : std::vector<int>{})
    if (under_root.count(id)) order.push_back(under_root.at(id));
  if (order.size() != under_root.size())
    throw std::invalid_argument(
        root_error(caller, root, "no recorded forward order of all its groups; run one training step first"));
  return order;
}

std::chrono::steady_clock::time_point g_recording_start;

// Every measured number of the model, in a fixed order (bytes are exact in a double up to 2^53).
template <class Visit>
void visit_measurements(plan::CostModel& model, Visit&& visit) {
  for (auto& g : model.groups) {
    for (int64_t* bytes : {&g.forward_peak_bytes, &g.saved_bytes, &g.recompute_saved_bytes, &g.backward_peak_bytes})
      visit(*bytes);
    for (double* ms : {&g.allgather_ms, &g.reduce_scatter_ms, &g.forward_ms, &g.backward_ms, &g.forward_cpu_ms,
                       &g.backward_cpu_ms, &g.handoff_ms, &g.handoff_cpu_ms})
      visit(*ms);
  }
  visit(model.allgather_latency_ms);
  visit(model.reduce_scatter_latency_ms);
  visit(model.fixed_bytes);
  visit(model.fixed_ms);
  visit(model.profiled_peak_bytes);
  visit(model.profiled_step_ms);
  visit(model.contention.allgather_stretch);
  visit(model.contention.reduce_scatter_stretch);
  visit(model.contention.compute_slowdown);
}

// Collective: each number becomes its largest over the ranks, so that every rank plans the same
// schedule (different ones would issue different collectives) and the plan fits the fullest rank.
void agree_across_ranks(plan::CostModel& model, Communicator& comm) {
  std::vector<double> values;
  visit_measurements(model, [&](auto& field) { values.push_back(static_cast<double>(field)); });
  const auto n = static_cast<int64_t>(values.size());
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor mine = at::from_blob(values.data(), {n}, opts).to(comm.device());
  at::Tensor all = at::empty({comm.world_size() * n}, opts.device(comm.device()));
  comm.all_gather(all, mine);
  const at::Tensor largest = std::get<0>(all.view({comm.world_size(), n}).max(0)).cpu();
  const double* agreed = largest.data_ptr<double>();
  size_t i = 0;
  visit_measurements(model, [&](auto& field) { field = static_cast<std::decay_t<decltype(field)>>(agreed[i++]); });
}

// The root's own group: the listed group every listed group is under (null when the root's own
// module is not sharded).
GroupState* own_group(const PlanningRoot& root) {
  for (const auto& [path, state] : root.groups)
    if (state->groups_under().size() == root.groups.size()) return state;
  return nullptr;
}

// What the planner needs of `groups` (groups_in_order(root)); `own` is own_group(root).
std::vector<plan::GroupShape> shapes_of(const std::vector<Group>& groups, const GroupState* own) {
  std::vector<plan::GroupShape> shapes;
  for (const Group& group : groups) {
    if (group.state->params().replicate())
      throw std::invalid_argument("fsdp::group_shapes: '" + group.path + "' is sharded with replicas (HSDP): the "
                                  "planner's cost model has no all-reduce across replicas; plan plain FSDP");
    plan::GroupShape shape;
    shape.name = group.path;
    shape.label = group.state->params().label();
    shape.memory = group.state->params().memory();
    shape.encloses_later = group.state == own && groups.size() > 1 && shapes.empty();
    shape.recomputable = !shape.encloses_later;
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

}  // namespace

PlanningRoot::PlanningRoot(const torch::nn::Module& root) : name(root.name()) {
  auto& mutable_root = const_cast<torch::nn::Module&>(root);  // named_modules() is not const
  for (const auto& item : mutable_root.named_modules("", /*include_self=*/true))
    if (GroupState* state = group_of_owner(item.value().get()))
      groups.emplace_back(item.key().empty() ? "root" : item.key(), state);
}

std::vector<plan::GroupShape> group_shapes(const PlanningRoot& root) {
  return shapes_of(groups_in_order(root, "group_shapes"), own_group(root));
}

plan::Schedule profiling_schedule(const PlanningRoot& root) {
  return plan::profiling_schedule(group_shapes(root));
}

void set_schedule(const PlanningRoot& root, const plan::Schedule& schedule) {
  const auto groups = groups_in_order(root, "set_schedule");
  if (schedule.reshard_after_forward.size() != groups.size() || schedule.recompute.size() != groups.size())
    throw std::invalid_argument(root_error("set_schedule", root,
                                           "the schedule has " + std::to_string(schedule.reshard_after_forward.size()) +
                                               " groups, the root " + std::to_string(groups.size())));
  if (!schedule.prefetch_depth.empty() && schedule.prefetch_depth.size() != groups.size())
    throw std::invalid_argument(root_error("set_schedule", root,
                                           "the schedule has " + std::to_string(schedule.prefetch_depth.size()) +
                                               " prefetch depths, the root " + std::to_string(groups.size()) +
                                               " groups"));
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].state->set_reshard_after_forward(schedule.reshard_after_forward[g]);
    set_prefetch_depth(*groups[g].state, schedule.prefetch_depth.empty() ? -1 : schedule.prefetch_depth[g]);
  }
  set_runtime_choices(root, schedule);
}

void set_runtime_choices(const PlanningRoot& root, const plan::Schedule& schedule) {
  GroupState* top = own_group(root);
  if (!top)
    throw std::invalid_argument(root_error("set_runtime_choices", root,
                                           "its own module is not sharded; fully_shard the root too (last)"));
  RuntimeOptions runtime = schedule.runtime;
  // Not a schedule's choice: the planner plans steps taken after backward, so the host worker's
  // cap stays the user's.
  runtime.max_pending_host_steps = runtime_options(*top).max_pending_host_steps;
  set_runtime_options(*top, runtime);
}

namespace {

void wait_for_device(const c10::Device& device) {
  const auto& streams = DeviceStreams::of(device);
  if (streams.active()) streams.record(streams.compute())->synchronize();
}

// Recording a step: the trace with or without memory marks, timed from here to finish_recording.
void start_recording(const char* caller, bool with_memory) {
  if (Trace::get().active())
    throw std::logic_error(std::string("fsdp::") + caller + ": a Chrome trace is being recorded; write it first");
  if (runtime_options().bucket_mb > 0)
    throw std::invalid_argument(std::string("fsdp::") + caller +
                                ": bucketing is on (bucket_mb > 0): the profile needs each group's collectives "
                                "apart; set bucket_mb to 0 for the recorded steps");
  // The previous step's kernels still queued on the device would be timed as this step's (on the
  // 1B, ~10 ms: the fit took it for contention and the planner avoided prefetching at depth 1).
  const c10::Device device = default_communicator()->device();
  if (with_memory && device.is_cpu() && !counting_host_allocations())
    throw std::logic_error(std::string("fsdp::") + caller +
                           ": host allocations are not counted, so the profile would see no memory on CPU ranks; "
                           "call fsdp::count_host_allocations() before the model is made");
  wait_for_device(device);
  Trace::get().start(device, with_memory);
  g_recording_start = std::chrono::steady_clock::now();
}

// The step's time: the one measured without recording where given (see planning.h), else this one.
plan::RecordedStep finish_recording(const char* caller, double untraced_step_ms) {
  if (!Trace::get().active())
    throw std::logic_error(std::string("fsdp::") + caller + ": no matching start before");
  const c10::Device device = default_communicator()->device();
  wait_for_device(device);  // the optimizer's work too
  const std::chrono::duration<double, std::milli> traced = std::chrono::steady_clock::now() - g_recording_start;
  Trace::Recording recording = Trace::get().finish();
  if (untraced_step_ms < 0)
    throw std::invalid_argument(std::string("fsdp::") + caller + ": untraced_step_ms is " +
                                std::to_string(untraced_step_ms) + "; pass a step's time in ms, or 0 for none");
  plan::RecordedStep step;
  step.host_is_device = device.is_cpu();
  step.step_ms = untraced_step_ms > 0 ? untraced_step_ms : traced.count();
  for (const auto& span : recording.spans)
    step.spans.push_back({span.name, span.start_ms, span.end_ms, span.host_start_ms, span.host_end_ms, span.start_mark,
                          span.end_mark});
  for (const auto& mark : recording.marks) step.marks.push_back({mark.allocated, mark.peak_since_last});
  return step;
}

// What a collective costs whatever its size (plan::CostModel's latencies): the mean of
// back-to-back all-gathers (and reduce-scatters) of one element a rank, between barriers (which
// wait for the device).
void measure_collective_latency(plan::CostModel& model, Communicator& comm) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(comm.device());
  const at::Tensor part = at::zeros({1}, opts), whole = at::zeros({comm.world_size()}, opts);
  constexpr int repeats = 20;
  const auto mean_ms = [&](auto&& collective) {
    collective();  // the first may set up buffers
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i) collective();
    comm.barrier();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / repeats;
  };
  model.allgather_latency_ms = mean_ms([&] { comm.all_gather(whole, part); });
  model.reduce_scatter_latency_ms = mean_ms([&] { comm.reduce_scatter(part, whole, ReduceOp::Avg); });
}

}  // namespace

void start_profiled_step() { start_recording("start_profiled_step", /*with_memory=*/true); }

plan::CostModel finish_profiled_step(const PlanningRoot& root, double untraced_step_ms, int micro_batches,
                                     bool reduce_every_micro_batch) {
  plan::RecordedStep step = finish_recording("finish_profiled_step", untraced_step_ms);
  if (micro_batches < 1 || (micro_batches > 1 && untraced_step_ms <= 0))
    throw std::invalid_argument("fsdp::finish_profiled_step: " + std::to_string(micro_batches) +
                                " micro-batches; more than one needs the untraced time of a whole step (the "
                                "recording holds only the last micro-batch)");
  step.micro_batches = micro_batches;
  step.reduce_every_micro_batch = reduce_every_micro_batch;
  const auto groups = groups_in_order(root, "finish_profiled_step");
  plan::CostModel model = plan::measure_cost_model(shapes_of(groups, own_group(root)), step);
  measure_collective_latency(model, groups.front().state->params().comm());
  agree_across_ranks(model, *default_communicator());
  return model;
}

plan::Schedule calibration_schedule(const PlanningRoot& root) {
  return plan::calibration_schedule(group_shapes(root));
}

void start_calibration_step() { start_recording("start_calibration_step", /*with_memory=*/false); }

void finish_calibration_step(const PlanningRoot& root, plan::CostModel& profile, double untraced_step_ms) {
  const plan::RecordedStep step = finish_recording("finish_calibration_step", untraced_step_ms);
  if (profile.micro_batches > 1 && untraced_step_ms <= 0)
    throw std::invalid_argument("fsdp::finish_calibration_step: the profile has " +
                                std::to_string(profile.micro_batches) +
                                " micro-batches: pass the untraced time of a whole step (the recording holds only "
                                "the last micro-batch)");
  plan::calibrate_contention(profile, group_shapes(root), step);
  agree_across_ranks(profile, *default_communicator());
}

ProfilingSteps::ProfilingSteps(PlanningRoot root, std::function<void(const plan::Schedule&)> apply,
                               int micro_batches, bool reduce_every_micro_batch)
    : root_(std::move(root)),
      apply_(std::move(apply)),
      micro_batches_(micro_batches),
      reduce_every_micro_batch_(reduce_every_micro_batch) {}

bool ProfilingSteps::before_step() {
  if (done()) throw std::logic_error(root_error("ProfilingSteps", root_, "its five steps are done"));
  if (next_ == 1) apply_(profiling_schedule(root_));
  if (next_ == 3) apply_(calibration_schedule(root_));
  return next_ == kProfiledStep || next_ == 4;
}

void ProfilingSteps::start_recording() const {
  if (next_ == kProfiledStep)
    start_profiled_step();
  else
    start_calibration_step();
}

void ProfilingSteps::after_step(double ms) {
  if (next_ == kProfiledStep)
    profile_ = finish_profiled_step(root_, untraced_ms_, micro_batches_, reduce_every_micro_batch_);
  else if (next_ == 4)
    finish_calibration_step(root_, *profile_, untraced_ms_);
  else
    untraced_ms_ = ms;  // what the recorded step after it takes as its time
  ++next_;
}

const plan::CostModel& ProfilingSteps::profile() const {
  if (!profile_) throw std::logic_error(root_error("ProfilingSteps::profile", root_, "no profiled step yet"));
  return *profile_;
}

plan::Plan plan_for_budget(const PlanningRoot& root, int64_t budget_bytes, const plan::CostModel& profile,
                           double margin) {
  const auto shapes = group_shapes(root);
  bool same = shapes.size() == profile.groups.size();
  for (size_t g = 0; same && g < shapes.size(); ++g) same = shapes[g].name == profile.groups[g].name;
  if (!same)
    throw std::invalid_argument(root_error("plan_for_budget", root,
                                           "the profile is not of its groups (in their forward order); profile this "
                                           "model with finish_profiled_step"));
  return plan::plan_schedule(profile, budget_bytes, margin);
}

}  // namespace fsdp
