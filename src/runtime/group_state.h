// Runtime state of one fully_shard call and the hooks that drive it.
//
// Life of a group in one training step:
//   forward   pre_forward: unshard (all-gather)      post_forward: hook the
//             outputs and the gradient accumulators, reshard (unless root or
//             reshard_after_forward=false)
//   backward  pre_backward (first output gradient): unshard again
//             on_gradient (each AccumulateGrad): when every trainable
//             parameter has its gradient, reduce-scatter and reshard
//             (with a step in backward: then commit them and step)
//   end       the engine's final callback: reduce-scatter / reshard whatever
//             is still outstanding (unused or frozen parameters, groups whose
//             gradients never all arrived), and step those groups
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/group.h"
#include "fsdp/options.h"
#include "fsdp/runtime_options.h"
#include "shard/group_params.h"

namespace fsdp {

class RootState;

class GroupState : public std::enable_shared_from_this<GroupState> {
 public:
  // `inner`: the groups sharded inside this one, at every depth (each fully_shard call is made
  // bottom-up, so they exist already).
  GroupState(std::string module_name, std::vector<std::pair<std::string, at::Tensor>> params,
             std::vector<std::shared_ptr<GroupState>> inner, const ShardOptions& options);

  const std::string& module_name() const { return module_name_; }
  int id() const { return id_; }
  bool reshard_after_forward() const { return reshard_after_forward_; }
  void set_reshard_after_forward(bool reshard) { reshard_after_forward_ = reshard; }
  // Groups all-gathered ahead at this group's start; -1: its root's prefetch_depth.
  int prefetch_depth() const { return prefetch_depth_; }
  void set_prefetch_depth(int depth) { prefetch_depth_ = depth; }
  GroupParams& params() { return params_; }
  // This group and those sharded inside it (that still exist).
  std::vector<std::shared_ptr<GroupState>> groups_under();
  // This group's scheduling options when it runs as a root (set_runtime_options); none: the
  // process-wide default.
  const std::optional<RuntimeOptions>& runtime_options() const { return runtime_options_; }
  void set_runtime_options(const RuntimeOptions& options) { runtime_options_ = options; }
  // The root it runs under; nullptr before its first forward.
  const RootState* root_state() const { return root_.get(); }
  const GroupParams& params() const { return params_; }

  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  // Forward left by an exception: undo pre_forward's bookkeeping.
  void abort_forward();

  // Called by autograd hooks.
  void pre_backward();
  void on_gradient(size_t param_index);
  // Called for every group of the step by the end-of-backward callback.
  void finish_backward();

  // false: backward keeps the gradients unsharded and sums them over backward passes
  // (GroupParams::hold_unsynced_gradients) instead of reduce-scattering them; the first backward
  // with true reduce-scatters the sum.
  void set_gradient_sync(bool sync) { gradient_sync_ = sync; }
  // fsdp::set_step_in_backward; empty: off. `frees_gradients`: the gradients go after the step
  // (else they stay as the step leaves them: a front end's hooks).
  void set_step_in_backward(StepInBackward step, bool frees_gradients) {
    step_in_backward_ = std::move(step);
    step_frees_gradients_ = frees_gradients;
  }
  // Whether the gradients are gone after backward (clip_grad_norm_ refuses).
  bool frees_gradients_in_backward() const { return step_in_backward_ && step_frees_gradients_; }
  // With a step in backward: steps the parameters whose sharded gradients this backward
  // committed, once (the end-of-backward callback calls it after committing the rest).
  void step_committed_gradients();

  // All-gathers ahead of use (no-op when unsharded already).
  void prefetch();
  // Back to shards; the memory's release is reported to the run-ahead limit.
  void reshard();

 private:
  // Issues the all-gather within the run-ahead limit.
  void unshard();
  // Once per backward: record it, unshard, prefetch the next groups in backward order.
  // `recompute`: it starts with a recomputed forward (activation checkpointing).
  void start_backward(bool recompute);
  void post_backward();
  // This backward's gradients leave the unsharded parameters: reduce-scatter, or held unsynced.
  // `reshard_first`: the group reshards before the hand-off allocates (GroupParams::take_gradients).
  void hand_off_gradients(bool reshard_first);
  void log_event(const char* event, const char* detail) const;
  std::optional<c10::Stream> compute_stream() const;
  void start_step(uint64_t step, bool is_root);
  void hook_gradient_accumulators();
  // The root this group runs under (Runtime::root_of gives it at the first forward).
  RootState& root();
  friend class Runtime;
  friend class RootState;

  std::string module_name_;
  GroupParams params_;
  std::vector<std::weak_ptr<GroupState>> inner_;
  std::optional<RuntimeOptions> runtime_options_;
  bool reshard_after_forward_;
  int prefetch_depth_ = -1;
  bool has_frozen_params_ = false;
  bool gradient_sync_ = true;
  StepInBackward step_in_backward_;
  bool step_frees_gradients_ = true;
  // A step in backward is set and this synced backward reduce-scattered gradients it has not
  // stepped yet (paid by the group's own step or the end-of-backward callback).
  bool step_owed_ = false;
  int trainable_params_ = 0;
  // The accumulator each trainable parameter's gradient last went through;
  // held so that it (and our hook on it) survives between steps.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;

  int id_ = -1;  // given by the Runtime; names the group in recorded orders
  std::shared_ptr<RootState> root_;
  int compute_span_ = -1;  // Chrome-trace span of the forward or backward running now

  // Per step.
  uint64_t step_ = 0;
  bool is_root_ = false;
  bool backward_started_ = false;
  bool reduced_ = false;
  int gradients_ready_ = 0;
};

}  // namespace fsdp
