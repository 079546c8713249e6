// The bookkeeping of one sharded root and the groups under it: its current step (one forward
// at depth 0 plus its backward), the groups in this step's forward order, the recorded forward
// and backward orders that steer prefetching, the in-flight queues and the reduce-scatter bucket.
//
// Each root has its own (as PyTorch FSDP2 keeps its shared context on the root's state), so a
// frozen teacher's forward between a student's forward and backward, an EMA copy's evaluation,
// or two models stepping alternately or on different communicators never mix their steps. The
// Runtime makes a RootState at a root's first forward and hands it to every sharded module under
// it (Runtime::root_of); what all roots share lives in the Runtime: the module registry, the
// options and counters, the recompute scopes, the device streams (shard/streams.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/runtime_options.h"
#include "sched/execution_order.h"
#include "sched/host_worker.h"
#include "sched/inflight_queue.h"
#include "shard/streams.h"

namespace fsdp {

class GroupState;
class GroupParams;

class RootState : public std::enable_shared_from_this<RootState> {
 public:
  // `top`: the outermost sharded group (the root's errors name it, its options are the root's);
  // `stats`: the Runtime's counters.
  RootState(std::weak_ptr<GroupState> top, RuntimeStats& stats);

  const std::string& top() const { return top_name_; }
  const std::weak_ptr<GroupState>& top_group() const { return top_group_; }
  // The scheduling options of this root: its top group's (set_runtime_options on it), else the
  // process-wide default.
  RuntimeOptions options() const;
  void add_member(const std::shared_ptr<GroupState>& state);
  // Moves every group of `other` (an idle root under this one) here.
  void adopt(RootState& other);
  // A forward or backward of this root is under way (another root may not take its groups).
  bool busy() const { return depth_ > 0 || callback_queued_; }

  // A forward at depth 0 starts a new step and is its root; its end closes
  // the forward pass (recording the order, resharding stray prefetches).
  void enter_forward(GroupState& state);
  void exit_forward();
  // The first group of a backward queues the callback that finishes every
  // group; each group's backward start is recorded in the backward order.
  void enter_backward(GroupState& state);

  // Groups to all-gather ahead of `state`, from the recorded orders, minus
  // any that already ran (or are running) in this pass.
  std::vector<GroupState*> forward_prefetch_targets(const GroupState& state);
  std::vector<GroupState*> backward_prefetch_targets(const GroupState& state);

  // All-gathers `state`'s group, with the small groups expected next when it
  // is small itself (bucketing), within the CPU run-ahead limit.
  void all_gather(GroupState& state);
  void after_reshard(std::shared_ptr<c10::Event> last_use);
  // Prepares `group`'s gradients and issues its reduce-scatter, or holds it
  // in the bucket until enough bytes are ready (flush_reduce_scatters).
  void reduce_scatter(GroupParams& group);
  void flush_reduce_scatters();
  // With a step in backward: commits `state`'s reduced gradients and steps them, on the host
  // worker for an offloaded group (RuntimeOptions::max_pending_host_steps), else here.
  void step_in_backward(GroupState& state);

  // Group ids in the forward order the last step recorded.
  const std::vector<int>& recorded_forward_order() const { return forward_pass_.recorded(); }

 private:
  void end_of_backward();
  void refresh_gather_transforms();
  void reshard_strays(bool only_idle_this_step);
  std::vector<GroupState*> prefetch_targets(const ExecutionOrder& order, const GroupState& state,
                                            bool backward);
  std::vector<std::shared_ptr<GroupState>> members() const;
  static GroupState* find_state(const std::vector<std::shared_ptr<GroupState>>& states, int id);
  bool ran_in_pass(const GroupState& state, bool backward) const;

  std::weak_ptr<GroupState> top_group_;
  std::string top_name_;
  RuntimeStats& stats_;
  std::vector<std::weak_ptr<GroupState>> members_;
  int depth_ = 0;
  uint64_t step_ = 0;
  std::vector<std::weak_ptr<GroupState>> forward_order_;  // groups of this step
  bool callback_queued_ = false;
  ExecutionOrder forward_pass_, backward_pass_;
  InflightQueue<DeviceWork> allgathers_, reduce_scatters_;
  std::vector<GroupParams*> reduce_bucket_;  // prepared, not yet issued
  size_t reduce_bucket_bytes_ = 0;
  int reduce_bucket_waited_ = 0;  // groups that joined the bucket after its first
  // Offloaded groups' steps in backward. Drained before any step runs on backward's thread and at
  // the end of backward (and, after a failed backward, at the next forward), so the step function
  // never runs twice at once and nothing else touches a group while it is stepped.
  HostWorker host_steps_;
};

}  // namespace fsdp
