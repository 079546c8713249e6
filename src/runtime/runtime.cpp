#include "runtime/runtime.h"

#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "fsdp/launch.h"
#include "runtime/group_state.h"
#include "runtime/root_state.h"
#include "shard/trace.h"

namespace fsdp {

Runtime& Runtime::get() {
  static Runtime runtime;
  return runtime;
}

void Runtime::drop_stale_locked() {
  for (auto it = states_.begin(); it != states_.end();) {
    if (!it->second.lifetime.expired()) {
      ++it;
      continue;
    }
    for (const auto& p : it->second.state->params().sharded())
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

void Runtime::add(const void* key, std::weak_ptr<const void> lifetime, std::shared_ptr<GroupState> state) {
  if (state->params().offloaded() && state->params().device().type() != at::kCPU) keep_states_at_exit();
  std::lock_guard<std::mutex> lock(mutex_);
  drop_stale_locked();
  state->id_ = next_id_++;
  state->params().set_label("#" + std::to_string(state->id_) + " " + state->module_name());
  const auto& params = state->params().sharded();
  for (size_t i = 0; i < params.size(); ++i)
    owners_[params[i].param.unsafeGetTensorImpl()] = ParamOwner{state, i};
  states_[key] = Entry{std::move(lifetime), std::move(state)};
}

GroupState* Runtime::state_of(const void* key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = states_.find(key);
  if (it == states_.end() || it->second.lifetime.expired()) return nullptr;
  return it->second.state.get();
}

std::optional<ParamOwner> Runtime::owner_of(const at::Tensor& param) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = owners_.find(param.unsafeGetTensorImpl());
  if (it == owners_.end()) return std::nullopt;
  return it->second;
}

bool Runtime::recomputing() { return torch::autograd::get_current_graph_task_id() != -1; }

RootState& Runtime::root_of(GroupState& state) {
  if (state.root_) return *state.root_;
  auto root = std::make_shared<RootState>(state.weak_from_this(), stats_);
  const auto under = state.groups_under();
  for (const auto& sub : under) {
    if (sub->root_ == root) continue;
    if (!sub->root_) {
      sub->root_ = root;
      root->add_member(sub);
      continue;
    }
    // A root of its own before (it ran forward or unshard() alone): if it lies inside this one and
    // is idle, its groups join this root. Held here: adopting its groups drops their references.
    const std::shared_ptr<RootState> held = sub->root_;
    RootState& other = *held;
    const auto other_top = other.top_group().lock();
    const bool other_under = std::find(under.begin(), under.end(), other_top) != under.end();
    if (!other_under || other.busy())
      throw std::invalid_argument(
          "fsdp::forward(" + state.module_name() + "): the sharded module '" + sub->module_name() +
          "' already runs under another root, " + other.top() +
          (other_under ? ", whose forward or backward is under way"
                       : "; a sharded module belongs to one root: give each model its own copy of it, or "
                         "shard a module holding both models and run them under it"));
    root->adopt(other);
  }
  return *state.root_;
}

RuntimeOptions Runtime::options() const { return options_; }
void Runtime::set_options(const RuntimeOptions& options) { options_ = options; }
RuntimeStats Runtime::stats() const { return stats_; }

void set_runtime_options(const RuntimeOptions& options) {
  check_runtime_options(options, "fsdp::set_runtime_options");
  Runtime::get().set_options(options);
}
RuntimeOptions runtime_options() { return Runtime::get().options(); }

void start_trace() { Trace::get().start(default_communicator()->device()); }
void write_trace(const std::string& path) {
  Trace::get().write(path, default_communicator()->rank());
}
RuntimeStats runtime_stats() { return Runtime::get().stats(); }

}  // namespace fsdp
