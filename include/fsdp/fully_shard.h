// The public API: fully_shard() a module, call it through fsdp::forward().
//
//   fsdp::init();                                  // communicator from the launcher
//   for (auto& block : model->blocks) fsdp::fully_shard(block);
//   fsdp::fully_shard(model);                      // root last: bottom-up
//   auto opt = torch::optim::AdamW(model->parameters(), ...);  // before or after: same
//   auto logits = fsdp::forward(model, tokens);    // inside the model too: fsdp::forward(block, x)
//
// libtorch modules have no forward hooks, so a sharded module's forward is
// called through fsdp::forward(module, args...), which all-gathers the
// module's parameters before and frees them after, and arms the backward
// hooks. For a module that is not sharded it is a plain call.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/group.h"
#include "fsdp/options.h"
#include "fsdp/runtime_options.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

class GroupState;

/// Shards the parameters of `module` not already sharded by an inner
/// fully_shard call into one parameter group: one all-gather before its
/// forward, one reduce-scatter after its backward. Apply bottom-up: to each
/// repeated block first, then to the root. Collective: every rank calls it in
/// the same order on the same model structure (checked).
///
/// The module's parameter tensors become this rank's shards in place (the
/// same tensor objects), so an optimizer created before or after this call
/// trains the same way; named_parameters() returns the shards. Each parameter
/// is split along dim 0, zero-padded where rows do not divide evenly.
std::shared_ptr<GroupState> fully_shard(torch::nn::Module& module,
                                        const ShardOptions& options = {});
namespace detail {
/// A module, a ModuleHolder (torch::nn::Linear) or a shared_ptr to a module.
template <class M>
torch::nn::Module& as_module(M& m) {
  if constexpr (std::is_base_of_v<torch::nn::Module, M>)
    return m;
  else
    return *m;
}
}  // namespace detail
template <class M>
std::shared_ptr<GroupState> fully_shard(M& module, const ShardOptions& options = {}) {
  return fully_shard(detail::as_module(module), options);
}

/// Gradient accumulation (the FSDP2 name). With false, backward passes through `root` and every
/// sharded module under it skip the reduce-scatter: each group keeps its gradients unsharded,
/// summed in the reduce dtype (memory: the sharded modules' full parameters in that dtype). The
/// first backward after set_requires_gradient_sync(root, true) reduce-scatters the sums. For K
/// micro-batches: false before the first K-1 backward passes, true before the last. Leaving sync
/// on reduce-scatters every micro-batch into the sharded gradients instead (less memory, K times
/// the communication). Not collective, but every rank must make the same calls.
void set_requires_gradient_sync(torch::nn::Module& root, bool sync);
template <class M>
void set_requires_gradient_sync(M& root, bool sync) {
  set_requires_gradient_sync(detail::as_module(root), sync);
}

/// The scheduling options (prefetch depth, caps, bucketing) of the root `root` alone, in place of
/// the process-wide default of set_runtime_options(options); takes effect from its next step.
/// `root` must be sharded (fully_shard on it). Not collective, but every rank must make the same
/// calls.
void set_runtime_options(torch::nn::Module& root, const RuntimeOptions& options);
template <class M>
void set_runtime_options(M& root, const RuntimeOptions& options) {
  set_runtime_options(detail::as_module(root), options);
}

/// The optimizer step in backward, group by group: once a sharded module's gradients are reduced
/// (for an offloaded module, copied to the host), `step` runs with its parameters that have a
/// gradient, and those gradients are freed right after, so only one group's sharded gradients
/// exist at a time (with CPU offload the host then holds 12 bytes a parameter instead of 16). For
/// optimizers whose update of a parameter reads only that parameter's gradient and state (AdamW,
/// SGD) it computes what one step after backward would, without gradient clipping:
/// clip_grad_norm_ throws while a step in backward is set. Each module's reduce-scatter then goes
/// out at its backward's end (no bucket waits for it). With gradient accumulation, turn gradient
/// sync off for every micro-batch but the last: each synced backward steps. An offloaded module's
/// step runs on a host thread of the root's while backward goes on issuing GPU work
/// (RuntimeOptions::max_pending_host_steps); `step` is never called twice at once, and backward
/// returns only after every step. Applies to `root` and every sharded module under it; an empty
/// `step` turns it off. Not collective.
void set_step_in_backward(torch::nn::Module& root, StepInBackward step);
template <class M>
void set_step_in_backward(M& root, StepInBackward step) {
  set_step_in_backward(detail::as_module(root), std::move(step));
}

/// The rows of a full parameter that `param` (a module's parameter tensor) holds on this rank:
/// [first_row, first_row + rows) of a tensor of full_shape; all of them when it is not sharded.
struct ShardRows {
  int64_t first_row = 0;             ///< the first full row this rank holds
  int64_t rows = 0;                  ///< how many (0 on a rank past the last row)
  std::vector<int64_t> full_shape;   ///< the whole parameter's shape
  int64_t row_numel() const;         ///< elements in one row (1 for a 0-dim parameter)
};
/// See ShardRows. Not collective.
ShardRows shard_rows_of(const at::Tensor& param);

/// A parameter that takes no memory until fully_shard gives it this rank's rows: `shape` for
/// every reader of sizes(), one zero element behind it (stride 0). Create a large model's
/// parameters so on the device, shard it, then fill the shards (init_normal_, or weights read
/// from a file): no process ever holds the whole model.
at::Tensor deferred_parameter(at::IntArrayRef shape, const at::TensorOptions& options);

/// Fills `param` (sharded or not) with near-normal values of mean 0 and standard deviation `std`:
/// the sum of four uniforms (Irwin-Hall), bounded at +-3.46 std. Each value depends only on `seed`
/// and the element's position in the full parameter, through integer hashing and exact float64
/// arithmetic, so the same seed gives the same parameter on any number of ranks, bit for bit,
/// on CPU and GPU alike. Use a different seed per parameter.
void init_normal_(const at::Tensor& param, uint64_t seed, double std);

/// The state fully_shard attached to `module`, or nullptr.
GroupState* state_of(const torch::nn::Module& module);

/// Collective. A full (unsharded) copy of the parameter `name` of `root`.
at::Tensor full_parameter(torch::nn::Module& root, const std::string& name);
/// Collective. Full copies of every parameter and buffer of `root`, by name.
std::vector<std::pair<std::string, at::Tensor>> full_state_dict(torch::nn::Module& root);
/// Collective. Scales the sharded gradients of `root` so that their global
/// L2 norm is at most max_norm; returns the norm before clipping as a float32
/// scalar tensor on the device. Like PyTorch's clip_grad_norm_ it never waits
/// for the device; call .item() only where the number is needed.
at::Tensor clip_grad_norm_(torch::nn::Module& root, double max_norm);
/// Collective. The global L2 norm of the sharded gradients of `root`, left unscaled
/// (clip_grad_norm_ without the clip; see grad_norm(const NamedTensors&)).
at::Tensor grad_norm(torch::nn::Module& root);
/// Not collective: moves nothing between ranks. An exponential moving average kept as shards:
/// every parameter of `ema` becomes decay * itself + (1 - decay) * the same parameter of
/// `model`, on the rows this rank holds (buffers are left as they are). `ema` must be sharded as
/// `model` is (the same structure, fully_shard on the same modules with the same communicator),
/// so that each rank holds the same rows of both; throws std::invalid_argument naming the first
/// parameter whose name, shape, rows, dtype or device differ, or a decay outside [0, 1]. For an
/// EMA copy of a model in training, evaluated forward-only (fsdp::forward under
/// torch::NoGradGuard).
void ema_update_(torch::nn::Module& ema, torch::nn::Module& model, double decay);

namespace detail {

/// Brackets one sharded module's forward: unshards on construction; finish()
/// arms backward and reshards; an exception leaves through the destructor.
class ForwardScope {
 public:
  explicit ForwardScope(GroupState& state);
  ~ForwardScope();
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
  void finish(const std::vector<at::Tensor>& outputs);

 private:
  GroupState& state_;
  bool finished_ = false;
};

inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) {
  out.push_back(t);
}
inline void collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out);
template <class... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out);
/// Outputs of other types carry no tensors to hook.
template <class T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}
template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <class... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, t);
}

}  // namespace detail

/// Calls module->forward(args...) with FSDP's pre- and post-forward work when
/// `module` (a ModuleHolder or shared_ptr to a module) is sharded.
template <class M, class... Args>
auto forward(M& module, Args&&... args) {
  GroupState* state = state_of(detail::as_module(module));
  if (!state) return module->forward(std::forward<Args>(args)...);
  detail::ForwardScope scope(*state);
  auto output = module->forward(std::forward<Args>(args)...);
  std::vector<at::Tensor> tensors;
  detail::collect_tensors(output, tensors);
  scope.finish(tensors);
  return output;
}

}  // namespace fsdp
