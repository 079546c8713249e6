// Process-wide bookkeeping shared by all fully_shard states: which module
// owns which state and parameter, the current step (one root forward plus its
// backward), the groups in forward order, and the end-of-backward callback.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fsdp {

class ModuleState;

struct ParamOwner {
  std::shared_ptr<ModuleState> state;
  size_t index = 0;  // in state->group().params()
};

class Runtime {
 public:
  static Runtime& get();

  // Modules are remembered weakly: a state whose module was destroyed is
  // dropped, so a new module at the same address starts unsharded.
  void add(const std::shared_ptr<const torch::nn::Module>& module,
           std::shared_ptr<ModuleState> state);
  ModuleState* state_of(const torch::nn::Module& module) const;
  // The state managing this parameter (by tensor identity), if any.
  std::optional<ParamOwner> owner_of(const at::Tensor& param) const;

  // A forward at depth 0 starts a new step and is its root.
  void enter_forward(ModuleState& state);
  void exit_forward();
  // Queues (once per backward) the callback that finishes every group.
  void ensure_end_of_backward_callback();

 private:
  struct Entry {
    std::weak_ptr<const torch::nn::Module> module;
    std::shared_ptr<ModuleState> state;
  };
  void end_of_backward();
  void drop_stale_locked();

  mutable std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, Entry> states_;
  std::unordered_map<const void*, ParamOwner> owners_;  // key: TensorImpl*
  int depth_ = 0;
  uint64_t step_ = 0;
  std::vector<std::weak_ptr<ModuleState>> forward_order_;
  bool callback_queued_ = false;
};

}  // namespace fsdp
