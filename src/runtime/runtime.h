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

#include "fsdp/runtime_options.h"
#include "sched/execution_order.h"
#include "sched/inflight_queue.h"
#include "shard/streams.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

class ModuleState;
class ParamGroup;

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

  // A forward at depth 0 starts a new step and is its root; its end closes
  // the forward pass (recording the order, resharding stray prefetches).
  void enter_forward(ModuleState& state);
  void exit_forward();
  // The first group of a backward queues the callback that finishes every
  // group; each group's backward start is recorded in the backward order.
  void enter_backward(ModuleState& state);

  // Groups to all-gather ahead of `state`, from the recorded orders, minus
  // any that already ran (or are running) in this pass.
  std::vector<ModuleState*> forward_prefetch_targets(const ModuleState& state);
  std::vector<ModuleState*> backward_prefetch_targets(const ModuleState& state);

  // All-gathers `state`'s group, with the small groups expected next when it
  // is small itself (bucketing), within the CPU run-ahead limit.
  void all_gather(ModuleState& state);
  void after_reshard(std::shared_ptr<c10::Event> last_use);
  // Prepares `group`'s gradients and issues its reduce-scatter, or holds it
  // in the bucket until enough bytes are ready (flush_reduce_scatters).
  void reduce_scatter(ParamGroup& group);
  void flush_reduce_scatters();
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

  // Group ids in the forward order the last step recorded.
  const std::vector<int>& recorded_forward_order() const { return forward_pass_.recorded(); }

  RuntimeOptions options() const;
  void set_options(const RuntimeOptions& options);
  RuntimeStats stats() const;

 private:
  struct Entry {
    std::weak_ptr<const torch::nn::Module> module;
    std::shared_ptr<ModuleState> state;
  };
  void end_of_backward();
  void drop_stale_locked();
  static void keep_states_at_exit();
  void reshard_strays(bool only_idle_this_step);
  std::vector<ModuleState*> prefetch_targets(const ExecutionOrder& order, const ModuleState& state,
                                             bool backward);
  std::vector<std::shared_ptr<ModuleState>> all_states() const;
  static ModuleState* find_state(const std::vector<std::shared_ptr<ModuleState>>& states, int id);
  size_t bucket_bytes() const;
  bool ran_in_pass(const ModuleState& state, bool backward) const;
  static void make_room(InflightQueue<DeviceWork>& queue, int limit, long& waits);

  mutable std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, Entry> states_;
  std::unordered_map<const void*, ParamOwner> owners_;  // key: TensorImpl*
  int depth_ = 0;
  uint64_t step_ = 0;
  std::vector<std::weak_ptr<ModuleState>> forward_order_;  // groups of this step
  bool callback_queued_ = false;
  int recomputing_ = 0;
  int checkpointed_forward_ = 0;
  int next_id_ = 0;
  RuntimeOptions options_;
  RuntimeStats stats_;
  ExecutionOrder forward_pass_, backward_pass_;
  InflightQueue<DeviceWork> allgathers_, reduce_scatters_;
  std::vector<ParamGroup*> reduce_bucket_;  // prepared, not yet issued
  size_t reduce_bucket_bytes_ = 0;
};

}  // namespace fsdp
