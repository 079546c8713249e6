// Whole-model views of sharded state: full parameters, state dicts, and the
// global gradient norm.
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <cmath>
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

double clip_grad_norm_(torch::nn::Module& root, double max_norm) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
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
    comm = &owner->state->group().comm();
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (!comm) return 0.0;
  // Shards hold disjoint rows (padding excluded), so the squared norms add up.
  at::Tensor sum_sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(comm->device()));
  for (const auto& g : grads) sum_sq += g.to(at::kDouble).pow(2).sum();
  comm->all_reduce(sum_sq, ReduceOp::Sum);
  const double norm = std::sqrt(sum_sq.item<double>());
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0)
    for (auto& g : grads) g.mul_(scale);
  return norm;
}

}  // namespace fsdp
