// Process-wide bookkeeping shared by all sharded groups: which owner (a C++ or Python module) has
// which group, which group each parameter belongs to, which root each group runs under (a RootState,
// made at the root's first forward), the default scheduling options and counters, and the scope
// of a recomputed forward. Everything
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

namespace fsdp {

class RecomputedForwardScope;
class GroupState;
class RootState;

struct ParamOwner {
  std::shared_ptr<GroupState> state;
  size_t index = 0;  // in state->params().sharded()
};

class Runtime {
 public:
  static Runtime& get();

  // Owners are remembered weakly: a group whose owner (`lifetime`) was destroyed is dropped, so a
  // new owner at the same address starts unsharded. `key`: the owner's address.
  void add(const void* key, std::weak_ptr<const void> lifetime, std::shared_ptr<GroupState> state);
  GroupState* state_of(const void* key) const;
  // The state managing this parameter (by tensor identity), if any.
  std::optional<ParamOwner> owner_of(const at::Tensor& param) const;

  // The root `state` runs under: given at its first forward to `state` and every group inside it
  // (`state` being the outermost one running then), or moved there from an idle root of a group
  // inside it. Throws std::invalid_argument where a group inside it already runs under another
  // root (one sharded module shared by two models).
  RootState& root_of(GroupState& state);
  // A new step's number, unique across roots.
  uint64_t new_step() { return ++steps_; }
  void count_prefetch() { ++stats_.prefetches; }

  // A forward run while autograd executes a backward is an activation-checkpoint recomputation
  // (fsdp::recompute, torch.utils.checkpoint): not a new step, not part of the forward order.
  static bool recomputing();
  // Inside a RecomputedForwardScope (fsdp/group.h): forwards under activation checkpointing
  // whose backward (the recompute) still comes, so reshard_after_forward = false keeps their
  // parameters.
  bool in_recomputed_forward() const { return recomputed_forward_ > 0; }

  // The default options, for roots that set none of their own (RootState::options).
  RuntimeOptions options() const;
  void set_options(const RuntimeOptions& options);
  RuntimeStats stats() const;

 private:
  struct Entry {
    std::weak_ptr<const void> lifetime;
    std::shared_ptr<GroupState> state;
  };
  void drop_stale_locked();
  static void keep_states_at_exit();

  mutable std::mutex mutex_;
  std::unordered_map<const void*, Entry> states_;
  std::unordered_map<const void*, ParamOwner> owners_;  // key: TensorImpl*
  uint64_t steps_ = 0;
  int recomputed_forward_ = 0;
  friend class RecomputedForwardScope;
  int next_id_ = 0;
  RuntimeOptions options_;
  RuntimeStats stats_;
};

}  // namespace fsdp
