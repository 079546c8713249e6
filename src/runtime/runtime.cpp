#include "runtime/runtime.h"

#include <torch/csrc/autograd/engine.h>

#include "runtime/module_state.h"

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

void Runtime::add(const std::shared_ptr<const torch::nn::Module>& module,
                  std::shared_ptr<ModuleState> state) {
  std::lock_guard<std::mutex> lock(mutex_);
  drop_stale_locked();
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

void Runtime::enter_forward(ModuleState& state) {
  const bool is_root = depth_ == 0;
  if (is_root) {
    ++step_;
    forward_order_.clear();
    callback_queued_ = false;
  }
  if (state.step_ != step_) forward_order_.push_back(state.weak_from_this());
  state.start_step(step_, is_root);
  ++depth_;
}

void Runtime::exit_forward() { --depth_; }

void Runtime::ensure_end_of_backward_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
}

// Groups finish in reverse forward order, the order their backward ran in,
// so all ranks issue any outstanding reduce-scatters in the same order.
void Runtime::end_of_backward() {
  callback_queued_ = false;
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
    if (auto state = it->lock()) state->finish_backward();
}

}  // namespace fsdp
