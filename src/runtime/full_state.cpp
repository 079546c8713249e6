// Whole-model views of sharded state: full parameters, state dicts, and the
// global gradient norm.
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

#include "fsdp/fully_shard.h"
#include "runtime/module_state.h"
#include "runtime/runtime.h"

namespace fsdp {

at::Tensor full_parameter(torch::nn::Module& root, const std::string& name) {
  auto params = root.named_parameters(/*recurse=*/true);
  const at::Tensor* t = params.find(name);
  if (!t) throw std::invalid_argument("fsdp::full_parameter: no parameter named '" + name + "'");
  c10::NoGradGuard no_grad;
  if (auto owner = Runtime::get().owner_of(*t)) return owner->state->group().gather_full(owner->index);
  return t->detach().clone();
}

std::vector<std::pair<std::string, at::Tensor>> full_state_dict(torch::nn::Module& root) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : root.named_parameters(/*recurse=*/true))
    out.emplace_back(item.key(), full_parameter(root, item.key()));
  for (const auto& item : root.named_buffers(/*recurse=*/true))
    out.emplace_back(item.key(), item.value().detach().clone());
  return out;
}

at::Tensor clip_grad_norm_(torch::nn::Module& root, double max_norm) {
  c10::NoGradGuard no_grad;
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> grads;  // by device: offloaded ones on the host
  Communicator* comm = nullptr;
  std::unordered_set<const void*> seen;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    auto owner = Runtime::get().owner_of(p);
    if (!owner)
      throw std::invalid_argument("fsdp::clip_grad_norm_: parameter '" + item.key() +
                                  "' is not sharded: apply fully_shard to the root module too");
    if (owner->state->group().is_unsharded())
      throw std::logic_error("fsdp::clip_grad_norm_: call it after backward, not between "
                             "forward and backward ('" + item.key() + "' is unsharded)");
    if (owner->state->steps_in_backward())
      throw std::logic_error("fsdp::clip_grad_norm_: the optimizer steps in backward (set_step_in_backward), so the "
                             "gradients are applied and gone before the norm could be taken; clip without it");
    comm = &owner->state->group().comm();
    if (!p.grad().defined()) continue;
    auto it = std::find_if(grads.begin(), grads.end(), [&](const auto& g) { return g.first == p.grad().device(); });
    if (it == grads.end()) it = grads.insert(grads.end(), {p.grad().device(), {}});
    it->second.push_back(p.grad());
  }
  if (!comm) return at::zeros({});
  // Shards hold disjoint rows (padding excluded), so the squared norms add
  // up. Gradients on the device stay there: no host sync, so the optimizer's
  // kernels can be queued while backward still runs.
  const auto on_device = at::TensorOptions().dtype(at::kFloat).device(comm->device());
  at::Tensor sum_sq = at::zeros({1}, on_device);
  for (const auto& [device, list] : grads)
    sum_sq += at::stack(at::_foreach_norm(list, 2, at::kFloat)).square().sum().reshape({1}).to(comm->device());
  comm->all_reduce(sum_sq, ReduceOp::Sum);
  at::Tensor norm = sum_sq.sqrt().reshape({});
  const at::Tensor scale = (max_norm / (norm + 1e-6)).clamp_max(1.0);
  for (auto& [device, list] : grads) at::_foreach_mul_(list, scale.to(device));
  return norm;
}

}  // namespace fsdp
