// Process-wide bookkeeping shared by all fully_shard states: which module owns which state and
// parameter, which root each state belongs to (a RootState, made at the root's first forward),
// the scheduling options and counters, and the scopes of activation checkpointing. Everything
// of one step (orders, queues, the end-of-backward callback) is the root's: root_state.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "fsdp/runtime_options.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

class ModuleState;
class RootState;

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

  // The root `state` runs under: given at its first forward to every sharded module under it
  // (`state` being the outermost one running then), or moved there from an idle root of a module
  // under it. Throws std::invalid_argument where a module under it already runs under another
  // root (one sharded module shared by two models).
  RootState& root_of(ModuleState& state);
  // A new step's number, unique across roots.
  uint64_t new_step() { return ++steps_; }
  void count_prefetch() { ++stats_.prefetches; }

  // While alive, forwards are activation-checkpoint recomputations inside
  // backward: not a new step, not part of the forward order.
  class RecomputeScope {
   public:
    RecomputeScope() { ++get().recomputing_; }
    ~RecomputeScope() { --get().recomputing_; }
  };
  bool recomputing() const { return recomputing_ > 0; }
  // While alive, forwards run without autograd under activation checkpointing: their backward
  // (the recompute) still comes, so reshard_after_forward = false keeps their parameters.
  class CheckpointedForwardScope {
   public:
    CheckpointedForwardScope() { ++get().checkpointed_forward_; }
    ~CheckpointedForwardScope() { --get().checkpointed_forward_; }
  };
  bool in_checkpointed_forward() const { return checkpointed_forward_ > 0; }

  RuntimeOptions options() const;
  void set_options(const RuntimeOptions& options);
  RuntimeStats stats() const;

 private:
  struct Entry {
    std::weak_ptr<const torch::nn::Module> module;
    std::shared_ptr<ModuleState> state;
  };
  void drop_stale_locked();
  static void keep_states_at_exit();
  std::shared_ptr<const torch::nn::Module> module_of(const ModuleState& state) const;

  mutable std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, Entry> states_;
  std::unordered_map<const void*, ParamOwner> owners_;  // key: TensorImpl*
  uint64_t steps_ = 0;
  int recomputing_ = 0;
  int checkpointed_forward_ = 0;
  int next_id_ = 0;
  RuntimeOptions options_;
  RuntimeStats stats_;
};

}  // namespace fsdp
