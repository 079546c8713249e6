#include "runtime/runtime.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "fsdp/launch.h"
#include "runtime/module_state.h"
#include "shard/trace.h"

namespace fsdp {

Runtime& Runtime::get() {
  static Runtime runtime;
  return runtime;
}

void Runtime::drop_stale_locked() {
  for (auto it = states_.begin(); it != states_.end();) {
    if (!it->second.module.expired()) {
      ++it;
      continue;
    }
    for (const auto& p : it->second.state->group().params())
      owners_.erase(p.param.unsafeGetTensorImpl());
    it = states_.erase(it);
  }
}

// Offloaded groups hold pinned host memory (their shards, and the gradients aliasing the reduce-
// scatter results), which CUDA's host allocator cannot take back once CUDA is torn down at exit,
// and the registry is a static destroyed after that. So an exit handler, registered with the first
// such group, hands the registry's states to a holder that is never freed: the process is ending
// and the system reclaims the memory.
void Runtime::keep_states_at_exit() {
  static std::once_flag registered;
  std::call_once(registered, [] {
    std::atexit([] {
      Runtime& runtime = get();
      std::lock_guard<std::mutex> lock(runtime.mutex_);
      new auto(std::move(runtime.states_));  // NOLINT: leaked on purpose
      runtime.states_.clear();
      runtime.owners_.clear();
    });
  });
}

void Runtime::add(const std::shared_ptr<const torch::nn::Module>& module,
                  std::shared_ptr<ModuleState> state) {
  if (state->group().offloaded() && state->group().device().type() != at::kCPU) keep_states_at_exit();
  std::lock_guard<std::mutex> lock(mutex_);
  drop_stale_locked();
  state->id_ = next_id_++;
  state->group().set_label("#" + std::to_string(state->id_) + " " + state->module_name());
  const auto& params = state->group().params();
  for (size_t i = 0; i < params.size(); ++i)
    owners_[params[i].param.unsafeGetTensorImpl()] = ParamOwner{state, i};
  states_[module.get()] = Entry{module, std::move(state)};
}

ModuleState* Runtime::state_of(const torch::nn::Module& module) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = states_.find(&module);
  if (it == states_.end() || it->second.module.expired()) return nullptr;
  return it->second.state.get();
}

std::optional<ParamOwner> Runtime::owner_of(const at::Tensor& param) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = owners_.find(param.unsafeGetTensorImpl());
  if (it == owners_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::shared_ptr<ModuleState>> Runtime::all_states() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<ModuleState>> out;
  for (const auto& [module, entry] : states_)
    if (!entry.module.expired()) out.push_back(entry.state);
  return out;
}

void Runtime::enter_forward(ModuleState& state) {
  if (recomputing()) {
    ++depth_;
    return;
  }
  const bool is_root = depth_ == 0;
  if (is_root) {
    ++step_;
    forward_order_.clear();
    callback_queued_ = false;
    forward_pass_.begin_pass();
  }
  if (state.step_ != step_) {
    forward_order_.push_back(state.weak_from_this());
    if (!forward_pass_.observe(state.id_)) ++stats_.order_departures;
  }
  state.start_step(step_, is_root);
  ++depth_;
}

void Runtime::exit_forward() {
  if (--depth_ > 0 || recomputing()) return;
  forward_pass_.end_pass();
  reshard_strays(/*only_idle_this_step=*/true);
}

void Runtime::enter_backward(ModuleState& state) {
  if (!callback_queued_) {
    callback_queued_ = true;
    backward_pass_.begin_pass();
    torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
  }
  if (!backward_pass_.observe(state.id_)) ++stats_.order_departures;
}

// A prefetched group that did not run (the order changed) holds memory for
// nothing: give it back. Forward end: groups that did not run this step;
// backward end: every group still unsharded.
void Runtime::reshard_strays(bool only_idle_this_step) {
  for (const auto& state : all_states())
    if (state->group().is_unsharded() && (!only_idle_this_step || state->step_ != step_))
      state->reshard();
}

// In forward: the group's forward already ran this step. In backward: its
// backward already started, or it did not run forward this step (so it has
// no backward to run).
bool Runtime::ran_in_pass(const ModuleState& state, bool backward) const {
  return backward ? state.backward_started_ || state.step_ != step_ : state.step_ == step_;
}

std::vector<ModuleState*> Runtime::prefetch_targets(const ExecutionOrder& order,
                                                    const ModuleState& state, bool backward) {
  std::vector<ModuleState*> targets;
  const auto ids = order.next(state.id_, options_.prefetch_depth);
  if (ids.empty()) return targets;
  const auto states = all_states();
  // In execution order, never the registry's (ordered by address, which
  // differs between processes): every rank must issue the same all-gathers
  // in the same order, or equal-sized ones silently trade data.
  for (int id : ids) {
    ModuleState* candidate = find_state(states, id);
    // Guards against a stale order: never prefetch a group that already ran
    // in this pass (it would be gathered again for nothing).
    if (candidate && !ran_in_pass(*candidate, backward)) targets.push_back(candidate);
  }
  return targets;
}

ModuleState* Runtime::find_state(const std::vector<std::shared_ptr<ModuleState>>& states, int id) {
  auto it = std::find_if(states.begin(), states.end(), [id](const auto& s) { return s->id_ == id; });
  return it == states.end() ? nullptr : it->get();
}

std::vector<ModuleState*> Runtime::forward_prefetch_targets(const ModuleState& state) {
  return prefetch_targets(forward_pass_, state, /*backward=*/false);
}

std::vector<ModuleState*> Runtime::backward_prefetch_targets(const ModuleState& state) {
  return prefetch_targets(backward_pass_, state, /*backward=*/true);
}

// Applies the current cap and counts the times the CPU had to wait.
void Runtime::make_room(InflightQueue<DeviceWork>& queue, int limit, long& waits) {
  const long before = queue.waits();
  queue.set_limit(limit);
  queue.make_room();
  waits += queue.waits() - before;
}

size_t Runtime::bucket_bytes() const {
  return static_cast<size_t>(options_.bucket_mb * 1024.0 * 1024.0);
}

void Runtime::all_gather(ModuleState& state) {
  std::vector<ParamGroup*> groups{&state.group()};
  const size_t limit = bucket_bytes();
  size_t bytes = state.group().unsharded_size_bytes();
  if (limit > 0 && bytes < limit) {
    // The groups expected next, while they are small, fit and have not run.
    const bool backward = callback_queued_ || recomputing();
    const auto& order = backward ? backward_pass_ : forward_pass_;
    std::vector<std::shared_ptr<ModuleState>> states = all_states();
    for (int id : order.next(state.id_, static_cast<int>(states.size()))) {
      ModuleState* found = find_state(states, id);
      if (!found) break;
      ModuleState& next = *found;
      const size_t next_bytes = next.group().unsharded_size_bytes();
      if (ran_in_pass(next, backward) || next.group().is_unsharded() || &next.group().comm() != &state.group().comm() ||
          bytes + next_bytes > limit)
        break;
      groups.push_back(&next.group());
      bytes += next_bytes;
    }
  }
  make_room(allgathers_, options_.max_inflight_allgathers, stats_.allgather_waits);
  Trace::get().mark();  // what the compute before it left allocated (cost model)
  ParamGroup::unshard_together(groups);
  ++stats_.all_gathers;
}

void Runtime::after_reshard(std::shared_ptr<c10::Event> last_use) {
  if (last_use) allgathers_.push(DeviceWork{std::move(last_use), {}});
}

void Runtime::reduce_scatter(ParamGroup& group) {
  group.prepare_reduce_scatter();
  reduce_bucket_.push_back(&group);
  reduce_bucket_bytes_ += group.unsharded_size_bytes();
  if (reduce_bucket_bytes_ >= bucket_bytes()) flush_reduce_scatters();
}

void Runtime::flush_reduce_scatters() {
  if (reduce_bucket_.empty()) return;
  make_room(reduce_scatters_, options_.max_inflight_reduce_scatters, stats_.reduce_scatter_waits);
  reduce_scatters_.push(ParamGroup::reduce_scatter_together(reduce_bucket_));
  ++stats_.reduce_scatters;
  reduce_bucket_.clear();
  reduce_bucket_bytes_ = 0;
}

// Groups finish in reverse forward order, the order their backward ran in,
// so all ranks issue any outstanding reduce-scatters in the same order. Then
// the compute stream waits for each reduce-scatter and takes its result as
// the sharded gradients; after that every reduce-scatter input can go.
void Runtime::end_of_backward() {
  callback_queued_ = false;
  std::vector<std::shared_ptr<ModuleState>> groups;
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
    if (auto state = it->lock()) groups.push_back(std::move(state));
  for (auto& state : groups) state->finish_backward();
  flush_reduce_scatters();
  std::vector<ParamGroup*> committed;
  for (auto& state : groups) committed.push_back(&state->group());
  ParamGroup::commit_gradients(committed);
  reduce_scatters_.clear();
  backward_pass_.end_pass();
  reshard_strays(/*only_idle_this_step=*/false);
}

RuntimeOptions Runtime::options() const { return options_; }
void Runtime::set_options(const RuntimeOptions& options) { options_ = options; }
RuntimeStats Runtime::stats() const { return stats_; }

void set_runtime_options(const RuntimeOptions& options) {
  if (options.prefetch_depth < 0 || options.max_inflight_allgathers < 0 ||
      options.max_inflight_reduce_scatters < 0 || options.bucket_mb < 0)
    throw std::invalid_argument(
        "fsdp::set_runtime_options: prefetch depth, caps and bucket size must be >= 0");
  Runtime::get().set_options(options);
}
RuntimeOptions runtime_options() { return Runtime::get().options(); }

void start_trace() { Trace::get().start(default_communicator()->device()); }
void write_trace(const std::string& path) {
  Trace::get().write(path, default_communicator()->rank());
}
RuntimeStats runtime_stats() { return Runtime::get().stats(); }

}  // namespace fsdp
