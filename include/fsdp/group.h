// The module-agnostic core under fully_shard. A sharded group is a named list of parameter tensors
// plus the groups sharded inside it; the runtime (parameter groups, roots, scheduling, profiling
// for the planner, checkpoints) needs nothing else. Front ends find those in their module trees
// and call these: fsdp::fully_shard (fully_shard.h) for torch::nn modules, the Python package
// fsdpcpp (python/) for nn.Module. A program uses a front end; a new front end uses this.
//
//   auto group = fsdp::shard_group({"block", params, inner_groups, &module, lifetime}, options);
//   fsdp::group_pre_forward(*group);             // the module's forward pre-hook
//   ... the module's forward ...
//   fsdp::group_post_forward(*group, outputs);   // its forward hook (group_abort_forward on an error)
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/options.h"
#include "fsdp/runtime_options.h"

namespace fsdp {

class GroupState;  ///< a sharded group (runtime/group_state.h)

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// An optimizer step over some parameters, each holding its sharded gradient (set_step_in_backward
/// in fully_shard.h).
using StepInBackward = std::function<void(const std::vector<at::Tensor>& params)>;

/// What a front end knows of a group when it shards it.
struct GroupSpec {
  std::string name;  ///< how errors and traces name the group (its module's name)
  /// Its own parameters: not those of groups inside it, each tensor once (a tied weight under one
  /// name). They become this rank's shards in place: the same tensor objects.
  NamedTensors params;
  /// The groups sharded inside it, at every depth (sharding goes bottom-up, so they exist).
  std::vector<std::shared_ptr<GroupState>> inner;
  const void* owner = nullptr;         ///< its module's address: group_of_owner finds the group by it
  std::weak_ptr<const void> lifetime;  ///< the group is forgotten once this expires (its module's)
  std::string api = "fsdp::fully_shard";  ///< the call errors name: "fsdp::fully_shard(NAME): ..."
};

/// Collective: checks that every rank shards the same parameters (names, shapes, dtypes) on the
/// communicator's device (and, with HSDP, that the replicate group matches), shards them in place
/// into one parameter group and registers the group. Throws std::invalid_argument naming the
/// problem and the fix (an owner already sharded, a parameter on the wrong device, ranks that
/// differ).
std::shared_ptr<GroupState> shard_group(GroupSpec spec, const ShardOptions& options = {});
/// The group registered for `owner`, or nullptr.
GroupState* group_of_owner(const void* owner);
/// The group a parameter tensor belongs to, or nullptr.
std::shared_ptr<GroupState> group_of_parameter(const at::Tensor& param);
/// The group's name (GroupSpec::name).
const std::string& group_name(const GroupState& state);

/// A group's forward, bracketed: before it, the all-gather (and prefetches of the next groups);
/// after it, the backward hooks on `outputs` and the reshard. group_abort_forward undoes the
/// bookkeeping of a forward that threw. A forward run while autograd runs backward is a
/// recomputation (activation checkpointing): the start of the group's backward.
void group_pre_forward(GroupState& state);
void group_post_forward(GroupState& state, const std::vector<at::Tensor>& outputs);
void group_abort_forward(GroupState& state);

/// While alive: the first pass of a call checkpointed with autograd on (torch.utils.checkpoint,
/// non-reentrant), whose recompute comes in backward. The groups' forwards inside it start their
/// backward at their recompute, as under fsdp::recompute, not at their outputs' gradients (which
/// arrive just before it): so traces and the planner's profile see a recompute span.
class RecomputedForwardScope {
 public:
  RecomputedForwardScope();
  ~RecomputedForwardScope();
  RecomputedForwardScope(const RecomputedForwardScope&) = delete;
  RecomputedForwardScope& operator=(const RecomputedForwardScope&) = delete;
};

/// Gradient sync (set_requires_gradient_sync) for this group and every group inside it.
void set_requires_gradient_sync(GroupState& state, bool sync);
/// set_step_in_backward (fully_shard.h) for this group alone. With `frees_gradients` false the
/// gradients stay as `step` leaves them, and clip_grad_norm_ takes them: for a front end whose
/// step runs hooks (FSDP2's post-accumulate-grad hooks) that drop them or keep them. An empty
/// `step` turns it off.
void set_step_in_backward(GroupState& state, StepInBackward step, bool frees_gradients);
/// Whether the group frees its unsharded parameters after forward (ShardOptions).
void set_reshard_after_forward(GroupState& state, bool reshard);
bool reshard_after_forward(const GroupState& state);
/// How many groups the group's start (pre-forward, pre-backward) all-gathers ahead, following the
/// recorded order, instead of its root's RuntimeOptions::prefetch_depth: deeper before a group
/// whose compute is short beside the next all-gathers. -1: the root's again. Takes effect from the
/// group's next start; throws std::invalid_argument below -1.
void set_prefetch_depth(GroupState& state, int depth);
int prefetch_depth(const GroupState& state);
/// Frees the group's unsharded parameters now, if it holds them (FSDP2's FSDPModule.reshard).
void reshard(GroupState& state);
/// FSDP2's FSDPModule.unshard: issues the group's all-gather now (a no-op while it holds its
/// unsharded parameters), as a prefetch its next forward uses; wait_for_unshard makes the compute
/// stream wait for it. The parameters then hold their full values until reshard() or the end of
/// that forward (with reshard_after_forward).
void unshard(GroupState& state);
void wait_for_unshard(GroupState& state);
/// The scheduling options of the root whose top group is this one, instead of the process-wide
/// default (set_runtime_options(options)) for that root alone; takes effect from its next step.
/// Throws std::invalid_argument for negative values.
void set_runtime_options(GroupState& state, const RuntimeOptions& options);
/// The scheduling options that root runs with: its own, else the process-wide default.
RuntimeOptions runtime_options(const GroupState& state);

/// The copy of `param`'s shard in the compute dtype that its group keeps
/// (ShardOptions::keep_compute_shards), shaped as the sharded parameter, on the device: what its
/// next all-gather sends. Undefined where the group keeps none. An optimizer may write it from
/// the updated master values (rounded to nearest even, as a cast) and then call
/// mark_compute_shards_written; the all-gather reads it on its own stream, after the compute
/// stream's work issued before it.
at::Tensor compute_shard_of(const at::Tensor& param);
/// Says that the compute shards of `params` (each sharded, its group keeping them) hold their
/// masters' current values: the next all-gathers send them without a cast, until the master
/// changes again. Throws std::invalid_argument for a parameter whose group keeps none.
void mark_compute_shards_written(const std::vector<at::Tensor>& params);

/// Collective over the parameter's group. A full (unsharded) copy of `param`: its group's
/// parameter all-gathered, or a copy of it when it belongs to no group; for a tensor-parallel part
/// (fsdp/tensor_parallel.h), the whole parameter, from the parts of the tp ranks (collective over
/// them too).
at::Tensor full_parameter(const at::Tensor& param);
/// Collective. Scales the sharded gradients of `params` (each tensor once, all sharded) so that
/// their global L2 norm is at most max_norm; returns the norm before clipping (float32 scalar on
/// the device) without waiting for the device. Errors name the parameters by their names here.
/// Under tensor parallelism (some of `params` tp parts), every parameter of `params` is a part or
/// the same on every tp rank; collective over the tp ranks too.
at::Tensor clip_grad_norm_(const NamedTensors& params, double max_norm);
/// Collective. clip_grad_norm_ without the clip: the global L2 norm of the sharded gradients of
/// `params`, which it leaves as they are. For an optimizer that applies the clip as it reads the
/// gradients (a divisor of max(1, norm / max_norm)), saving clip_grad_norm_'s pass over them.
at::Tensor grad_norm(const NamedTensors& params);
/// The divisor that clips gradients of global norm `norm` to max_norm: max(1, (norm + 1e-6) /
/// max_norm), the inverse of the scale clip_grad_norm_ multiplies them by. Not collective.
at::Tensor clip_divisor(const at::Tensor& norm, double max_norm);

}  // namespace fsdp
