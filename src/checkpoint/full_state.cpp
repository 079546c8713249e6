// Whole-model views of sharded state for torch::nn modules: full parameters, state dicts, and
// the global gradient norm (over fsdp/group.h's per-parameter operations).
#include <torch/nn/module.h>

#include <stdexcept>

#include "fsdp/fully_shard.h"
#include "fsdp/group.h"

namespace fsdp {

at::Tensor full_parameter(torch::nn::Module& root, const std::string& name) {
  auto params = root.named_parameters(/*recurse=*/true);
  const at::Tensor* t = params.find(name);
  if (!t) throw std::invalid_argument("fsdp::full_parameter: no parameter named '" + name + "'");
  return full_parameter(*t);
}

std::vector<std::pair<std::string, at::Tensor>> full_state_dict(torch::nn::Module& root) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), full_parameter(item.value()));
  for (const auto& item : root.named_buffers(/*recurse=*/true))
    out.emplace_back(item.key(), item.value().detach().clone());
  return out;
}

at::Tensor clip_grad_norm_(torch::nn::Module& root, double max_norm) {
  return clip_grad_norm_(root.named_parameters(/*recurse=*/true).pairs(), max_norm);
}

at::Tensor grad_norm(torch::nn::Module& root) { return grad_norm(root.named_parameters(/*recurse=*/true).pairs()); }

}  // namespace fsdp
