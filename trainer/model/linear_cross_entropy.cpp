#include "model/linear_cross_entropy.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>

namespace fsdp::model {
namespace {

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk_rows, bool with_gradients) {
    const int64_t rows = hidden.size(0);
    const auto compute = c10::promoteTypes(hidden.scalar_type(), at::kFloat);
    at::Tensor loss_sum = at::zeros({}, hidden.options().dtype(compute));
    at::Tensor grad_hidden, grad_weight;
    if (with_gradients) {
      grad_hidden = at::empty_like(hidden);
      grad_weight = at::zeros_like(weight);
    }
    // Each chunk holds one float32 [n, vocab] buffer, turned in place into exp(logit - max),
    // then into the gradient of the mean loss: (softmax - one_hot(target)) / rows.
    const double inv_rows = 1.0 / static_cast<double>(rows);
    const at::Tensor minus_inv_rows =
        with_gradients ? at::full({chunk_rows, 1}, -inv_rows, hidden.options().dtype(compute)) : at::Tensor();
    for (int64_t first = 0; first < rows; first += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - first);
      const auto h = hidden.narrow(0, first, n);
      const auto target = targets.narrow(0, first, n).unsqueeze(1);
      auto logits = at::mm(h, weight.t()).to(compute);  // [n, vocab]
      const auto target_logit = logits.gather(1, target);
      const auto max = logits.amax(1, /*keepdim=*/true);
      const auto sum_exp = logits.sub_(max).exp_().sum(1, /*keepdim=*/true);
      loss_sum += (sum_exp.log() - (target_logit - max)).sum();
      if (!with_gradients) continue;
      logits.div_(sum_exp * static_cast<double>(rows));
      logits.scatter_add_(1, target, minus_inv_rows.narrow(0, 0, n));
      const auto grad_logits = logits.to(hidden.scalar_type());
      auto grad_rows = grad_hidden.narrow(0, first, n);
      at::mm_out(grad_rows, grad_logits, weight);
      grad_weight.addmm_(grad_logits.t(), h);
    }
    ctx->saved_data["grad_hidden"] = grad_hidden;
    ctx->saved_data["grad_weight"] = grad_weight;
    return loss_sum / static_cast<double>(rows);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto grad_hidden = ctx->saved_data.at("grad_hidden").toTensor();
    auto grad_weight = ctx->saved_data.at("grad_weight").toTensor();
    ctx->saved_data.clear();  // the only references: scaled in place, then handed on
    const auto scale = grads[0].to(grad_hidden.scalar_type());
    return {grad_hidden.mul_(scale), grad_weight.mul_(scale), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                int64_t chunk_bytes) {
  if (hidden.dim() != 2 || weight.dim() != 2 || hidden.size(1) != weight.size(1) || targets.dim() != 1 ||
      targets.size(0) != hidden.size(0) || hidden.scalar_type() != weight.scalar_type() ||
      targets.scalar_type() != at::kLong || hidden.size(0) == 0)
    throw std::invalid_argument(c10::str("linear_cross_entropy: hidden ", hidden.sizes(), " ", hidden.scalar_type(),
                                         ", weight ", weight.sizes(), " ", weight.scalar_type(), ", targets ",
                                         targets.sizes(), " ", targets.scalar_type(),
                                         ": need [rows > 0, dim], [vocab, dim] of one dtype and [rows] int64"));
  const int64_t chunk_rows = std::max<int64_t>(1, chunk_bytes / (weight.size(0) * int64_t(sizeof(float))));
  const int64_t chunks = (hidden.size(0) + chunk_rows - 1) / chunk_rows;
  const int64_t balanced_rows = (hidden.size(0) + chunks - 1) / chunks;  // equal chunks, not one short tail
  const bool with_gradients = c10::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  return LinearCrossEntropy::apply(hidden, weight, targets, balanced_rows, with_gradients);
}

}  // namespace fsdp::model
