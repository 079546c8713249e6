// The module-agnostic core (fsdp/group.h): sharding a group, its forward hooks, and the per-group
// and per-parameter operations every front end shares.
#include "fsdp/group.h"

#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <unordered_set>

#include "fsdp/float8.h"
#include "fsdp/launch.h"
#include "fsdp/tensor_parallel.h"
#include "runtime/group_state.h"
#include "runtime/runtime.h"

namespace fsdp {
namespace {

std::invalid_argument shard_error(const GroupSpec& spec, const std::string& why) {
  return std::invalid_argument(spec.api + "(" + spec.name + "): " + why);
}

uint64_t structure_hash(const NamedTensors& params) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](const void* data, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(data)[i]) * 1099511628211ull;
  };
  for (const auto& [name, t] : params) {
    mix(name.data(), name.size());
    int64_t dtype = static_cast<int64_t>(t.scalar_type());
    mix(&dtype, sizeof(dtype));
    for (int64_t d : t.sizes()) mix(&d, sizeof(d));
    // Gathered in float8 on one rank and in the compute dtype on another, the all-gather's
    // buffers would differ in size: a hang, caught here instead.
    const uint8_t float8 = float8_all_gather_enabled(t);
    mix(&float8, sizeof(float8));
  }
  return h;
}

std::invalid_argument structure_error(const GroupSpec& spec, int64_t first_hash, int64_t other_hash, int other_rank,
                                      const Communicator& comm) {
  char hashes[64];
  std::snprintf(hashes, sizeof(hashes), "%llx on rank 0 but %llx", static_cast<unsigned long long>(first_hash),
                static_cast<unsigned long long>(other_hash));
  return shard_error(spec, "the model differs across ranks: the parameters (names, shapes, dtypes, float8 "
                               "all-gather marks) hash to " +
                               std::string(hashes) + " on rank " + std::to_string(other_rank) + " of '" +
                               comm.name() + "' (this is rank " + std::to_string(comm.rank()) + ", " +
                               std::to_string(spec.params.size()) + " parameters here). Build the same model on "
                               "every rank, with the same weights marked by enable_float8_all_gather, before "
                               "sharding.");
}

// Every rank must shard the same parameters in the same order, or the collectives would exchange
// mismatched buffers.
void check_same_structure(Communicator& comm, const GroupSpec& spec) {
  const auto opts = at::TensorOptions().dtype(at::kLong).device(comm.device());
  at::Tensor mine = at::full({1}, static_cast<int64_t>(structure_hash(spec.params)), opts);
  at::Tensor all = at::empty({comm.world_size()}, opts);
  comm.all_gather(all, mine);
  all = all.cpu();
  const int64_t* h = all.data_ptr<int64_t>();
  for (int r = 1; r < comm.world_size(); ++r)
    if (h[r] != h[0]) throw structure_error(spec, h[0], h[r], r, comm);
}

// HSDP: a replicate communicator joins the ranks that hold the same shard of equally large shard
// communicators, with the same parameters (one all-gather of [shard rank, shard count, structure hash]).
void check_replicas(const Communicator& comm, Communicator& replicate, const GroupSpec& spec) {
  const std::string fix = ": make both communicators with fsdp::make_mesh";
  if (replicate.device() != comm.device())
    throw shard_error(spec, "the replicate communicator works on " + replicate.device().str() +
                                " but the shard communicator on " + comm.device().str() + fix);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(comm.device());
  at::Tensor all = at::empty({3 * replicate.world_size()}, opts);
  const auto hash = static_cast<int64_t>(structure_hash(spec.params));
  replicate.all_gather(all, at::tensor({int64_t(comm.rank()), int64_t(comm.world_size()), hash}, opts));
  all = all.cpu();
  const int64_t* row = all.data_ptr<int64_t>();
  const int64_t first_hash = row[2];
  for (int r = 0; r < replicate.world_size(); ++r, row += 3) {
    if (row[0] != comm.rank() || row[1] != comm.world_size())
      throw shard_error(spec, "rank " + std::to_string(r) + " of the replicate communicator '" + replicate.name() +
                                  "' holds shard " + std::to_string(row[0]) + " of " + std::to_string(row[1]) +
                                  ", this rank shard " + std::to_string(comm.rank()) + " of " +
                                  std::to_string(comm.world_size()) +
                                  "; a replicate communicator joins the ranks holding the same shard" + fix);
    if (row[2] != first_hash) throw structure_error(spec, first_hash, row[2], r, replicate);
  }
}

void check_devices(const GroupSpec& spec, const Communicator& comm) {
  for (const auto& [name, t] : spec.params)
    if (t.device().type() != comm.device().type() || (comm.device().has_index() && t.device() != comm.device()))
      throw shard_error(spec, "parameter '" + name + "' is on " + t.device().str() + " but the communicator (" +
                                  comm.backend() + ") works on " + comm.device().str() +
                                  ": move the model there before sharding");
}

}  // namespace

std::shared_ptr<GroupState> shard_group(GroupSpec spec, const ShardOptions& options) {
  if (spec.owner && Runtime::get().state_of(spec.owner))
    throw shard_error(spec, "this module is already sharded: call fully_shard once per module");
  for (const auto& [name, t] : spec.params)
    if (auto owner = Runtime::get().owner_of(t))
      throw shard_error(spec, "parameter '" + name + "' is already managed by fully_shard(" +
                                  owner->state->module_name() + "); shard each parameter in one group");
  ShardOptions resolved = options;
  if (!resolved.comm) resolved.comm = default_communicator();
  check_devices(spec, *resolved.comm);
  check_same_structure(*resolved.comm, spec);
  if (resolved.replicate) check_replicas(*resolved.comm, *resolved.replicate, spec);
  auto state = std::make_shared<GroupState>(spec.name, std::move(spec.params), std::move(spec.inner), resolved);
  Runtime::get().add(spec.owner ? spec.owner : state.get(), std::move(spec.lifetime), state);
  return state;
}

GroupState* group_of_owner(const void* owner) { return Runtime::get().state_of(owner); }

std::shared_ptr<GroupState> group_of_parameter(const at::Tensor& param) {
  auto owner = Runtime::get().owner_of(param);
  return owner ? owner->state : nullptr;
}

const std::string& group_name(const GroupState& state) { return state.module_name(); }

void group_pre_forward(GroupState& state) { state.pre_forward(); }
void group_post_forward(GroupState& state, const std::vector<at::Tensor>& outputs) { state.post_forward(outputs); }
void group_abort_forward(GroupState& state) { state.abort_forward(); }

RecomputedForwardScope::RecomputedForwardScope() { ++Runtime::get().recomputed_forward_; }
RecomputedForwardScope::~RecomputedForwardScope() { --Runtime::get().recomputed_forward_; }

void set_requires_gradient_sync(GroupState& state, bool sync) {
  for (const auto& under : state.groups_under()) under->set_gradient_sync(sync);
}
void set_step_in_backward(GroupState& state, StepInBackward step, bool frees_gradients) {
  state.set_step_in_backward(std::move(step), frees_gradients);
}
void set_reshard_after_forward(GroupState& state, bool reshard) { state.set_reshard_after_forward(reshard); }
bool reshard_after_forward(const GroupState& state) { return state.reshard_after_forward(); }
void set_prefetch_depth(GroupState& state, int depth) {
  if (depth < -1)
    throw std::invalid_argument("set_prefetch_depth: " + state.module_name() + "'s depth is " + std::to_string(depth) +
                                "; it must be 0 or more, or -1 for its root's prefetch_depth");
  state.set_prefetch_depth(depth);
}
int prefetch_depth(const GroupState& state) { return state.prefetch_depth(); }
void reshard(GroupState& state) {
  if (state.params().is_unsharded()) state.reshard();
}

void unshard(GroupState& state) { state.prefetch(); }
void wait_for_unshard(GroupState& state) { state.params().wait_for_unshard(); }

void set_runtime_options(GroupState& state, const RuntimeOptions& options) {
  check_runtime_options(options, "fsdp::set_runtime_options(" + group_name(state) + ")");
  state.set_runtime_options(options);
}

RuntimeOptions runtime_options(const GroupState& state) {
  return state.runtime_options().value_or(runtime_options());
}

at::Tensor compute_shard_of(const at::Tensor& param) {
  auto owner = Runtime::get().owner_of(param);
  return owner ? owner->state->params().compute_shard(owner->index) : at::Tensor();
}

void mark_compute_shards_written(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& param : params) {
    auto owner = Runtime::get().owner_of(param);
    if (!owner || !owner->state->params().compute_shard(owner->index).defined())
      throw std::invalid_argument("fsdp::mark_compute_shards_written: a parameter whose group keeps no compute "
                                  "shards (shard it with ShardOptions::keep_compute_shards)");
    owner->state->params().note_compute_shard_written(owner->index);
  }
}

at::Tensor full_parameter(const at::Tensor& param) {
  c10::NoGradGuard no_grad;
  auto owner = Runtime::get().owner_of(param);
  at::Tensor mine = owner ? owner->state->params().gather_full(owner->index) : param.detach().clone();
  const TpPart* part = tp_part_of(param);
  if (!part) return mine;
  // Every tp rank's part, then the full tensor from them.
  auto shape = mine.sizes().vec();
  shape.insert(shape.begin(), part->tp->world_size());
  at::Tensor parts = at::empty(shape, mine.options());
  part->tp->all_gather(parts, mine.contiguous());
  return part->assemble(parts);
}

namespace {

// The sharded gradients of `params` (each tensor once) by device, offloaded ones on the host, and
// the communicator their norm is summed over (null: no parameter). With tensor parallelism the
// parts of split parameters are listed apart from the parameters every tp rank holds alike.
struct ShardedGradients {
  using ByDevice = std::vector<std::pair<at::Device, std::vector<at::Tensor>>>;
  Communicator* comm = nullptr;
  Communicator* tp = nullptr;  // the tp communicator of the split parameters, if any
  ByDevice by_device, tp_parts_by_device;
};

// `caller` names the API in errors.
ShardedGradients sharded_gradients(const NamedTensors& params, const char* caller) {
  ShardedGradients out;
  std::unordered_set<const void*> seen;
  for (const auto& [name, p] : params) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    auto owner = Runtime::get().owner_of(p);
    if (!owner)
      throw std::invalid_argument(std::string(caller) + ": parameter '" + name +
                                  "' is not sharded: apply fully_shard to the root module too");
    if (owner->state->params().is_unsharded())
      throw std::logic_error(std::string(caller) + ": call it after backward, not between "
                             "forward and backward ('" + name + "' is unsharded)");
    if (owner->state->frees_gradients_in_backward())
      throw std::logic_error(std::string(caller) + ": the optimizer steps in backward (set_step_in_backward), so the "
                             "gradients are applied and gone before the norm could be taken; clip without it");
    out.comm = &owner->state->params().comm();
    const TpPart* part = tp_part_of(p);
    if (part) out.tp = part->tp.get();
    if (!p.grad().defined()) continue;
    auto& lists = part ? out.tp_parts_by_device : out.by_device;
    auto it = std::find_if(lists.begin(), lists.end(), [&](const auto& g) { return g.first == p.grad().device(); });
    if (it == lists.end()) it = lists.insert(lists.end(), {p.grad().device(), {}});
    it->second.push_back(p.grad());
  }
  return out;
}

at::Tensor sum_of_squares(const ShardedGradients::ByDevice& by_device, const at::Device& on) {
  at::Tensor sum_sq = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(on));
  for (const auto& [device, list] : by_device)
    sum_sq += at::stack(at::_foreach_norm(list, 2, at::kFloat)).square().sum().reshape({1}).to(on);
  return sum_sq;
}

// Shards hold disjoint rows (padding excluded), so the squared norms add up; so do the tp parts
// of a split parameter, while a parameter every tp rank holds alike counts once (its sum divided
// by tp before the tp ranks add theirs). Gradients on the device stay there: no host sync, so
// the optimizer's kernels can be queued while backward still runs.
at::Tensor global_norm(const ShardedGradients& grads) {
  if (!grads.comm) return at::zeros({});
  const at::Device on = grads.comm->device();
  at::Tensor sum_sq = sum_of_squares(grads.by_device, on);
  if (grads.tp) {
    sum_sq.div_(grads.tp->world_size()).add_(sum_of_squares(grads.tp_parts_by_device, on));
    grads.tp->all_reduce(sum_sq, ReduceOp::Sum);
  }
  grads.comm->all_reduce(sum_sq, ReduceOp::Sum);
  return sum_sq.sqrt().reshape({});
}

// Added to the norm before dividing by it, as PyTorch's clip_grad_norm_ does.
constexpr double kClipEpsilon = 1e-6;

}  // namespace

at::Tensor clip_divisor(const at::Tensor& norm, double max_norm) {
  return ((norm + kClipEpsilon) / max_norm).clamp_min(1.0);
}

at::Tensor grad_norm(const NamedTensors& params) {
  c10::NoGradGuard no_grad;
  return global_norm(sharded_gradients(params, "fsdp::grad_norm"));
}

at::Tensor clip_grad_norm_(const NamedTensors& params, double max_norm) {
  c10::NoGradGuard no_grad;
  const ShardedGradients grads = sharded_gradients(params, "fsdp::clip_grad_norm_");
  const at::Tensor norm = global_norm(grads);
  if (!grads.comm) return norm;
  const at::Tensor scale = (max_norm / (norm + kClipEpsilon)).clamp_max(1.0);
  for (const auto* lists : {&grads.by_device, &grads.tp_parts_by_device})
    for (const auto& [device, list] : *lists) at::_foreach_mul_(list, scale.to(device));
  return norm;
}

}  // namespace fsdp
