#include "model/linear_cross_entropy.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
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

#include "model/fused_ops.h"

#ifdef FSDP_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "kernels/kernel_launch.h"
#include "model/fused_kernels.h"
#endif

namespace fsdp::model {
namespace {

// A chunk's summed loss and, where asked, the gradient of the mean loss in its logits' dtype.
struct ChunkResult {
  at::Tensor loss_sum, grad_logits;
};

// The unfused path (CPUs, float64): a float32 copy of the chunk's logits, turned in place into
// exp(logit - max), then into (softmax - one_hot(target)) / rows.
ChunkResult chunk_in_aten_ops(const at::Tensor& logits_in, const at::Tensor& target, int64_t rows,
                              const at::Tensor& minus_inv_rows, bool with_gradients) {
  auto logits = logits_in.to(c10::promoteTypes(logits_in.scalar_type(), at::kFloat));  // [n, vocab]
  const auto target_logit = logits.gather(1, target);
  const auto max = logits.amax(1, /*keepdim=*/true);
  const auto sum_exp = logits.sub_(max).exp_().sum(1, /*keepdim=*/true);
  ChunkResult out{(sum_exp.log() - (target_logit - max)).sum(), at::Tensor()};
  if (!with_gradients) return out;
  logits.div_(sum_exp * static_cast<double>(rows));
  logits.scatter_add_(1, target, minus_inv_rows.narrow(0, 0, logits.size(0)));
  out.grad_logits = logits.to(logits_in.scalar_type());
  return out;
}

// The vocabulary split over the tp ranks (this rank's ids from `first_id`): chunk_in_aten_ops'
// arithmetic with each row's max, sum of exponentials and target logit combined over the ranks.
ChunkResult chunk_over_tp(const at::Tensor& logits_in, const at::Tensor& target, int64_t first_id, int64_t rows,
                          const at::Tensor& minus_inv_rows, bool with_gradients, Communicator& tp) {
  auto logits = logits_in.to(c10::promoteTypes(logits_in.scalar_type(), at::kFloat));  // [n, vocab / tp]
  const auto mine = (target >= first_id) & (target < first_id + logits.size(1));
  const auto local_target = (target - first_id) * mine;
  auto maxima = at::empty({tp.world_size(), logits.size(0), 1}, logits.options());
  tp.all_gather(maxima, logits.amax(1, /*keepdim=*/true).contiguous());
  const auto max = maxima.amax(0);
  const auto target_less_max = logits.sub_(max).gather(1, local_target) * mine;  // 0 where another rank's
  auto sums = at::cat({target_less_max, logits.exp_().sum(1, /*keepdim=*/true)}, 1);
  tp.all_reduce(sums, ReduceOp::Sum);  // [n, 2]: the target's logit less the max, the sum of exponentials
  const auto target_logit = sums.narrow(1, 0, 1), sum_exp = sums.narrow(1, 1, 1);
  ChunkResult out{(sum_exp.log() - target_logit).sum(), at::Tensor()};
  if (!with_gradients) return out;
  logits.div_(sum_exp * static_cast<double>(rows));
  logits.scatter_add_(1, local_target, minus_inv_rows.narrow(0, 0, logits.size(0)) * mine);
  out.grad_logits = logits.to(logits_in.scalar_type());
  return out;
}

// The GPU kernel (model/fused_kernels.h): the loss and the gradient in two reads of the logits,
// the gradient written over them.
ChunkResult chunk_in_kernel(at::Tensor logits, const at::Tensor& target, int64_t rows, bool with_gradients) {
#ifdef FSDP_WITH_CUDA_KERNELS
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor row_loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  kernels::cross_entropy(logits.data_ptr(), target.data_ptr<int64_t>(), row_loss.data_ptr<float>(), logits.size(0),
                         logits.size(1), rows, with_gradients, *kernels::kernel_dtype(logits),
                         kernels::current_stream(logits));
  return {row_loss.sum(), with_gradients ? logits : at::Tensor()};
#else
  throw std::logic_error("linear_cross_entropy: built without the CUDA kernels");
#endif
}

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk_rows, bool with_gradients, Communicator* tp) {
    const int64_t rows = hidden.size(0);
    const auto compute = c10::promoteTypes(hidden.scalar_type(), at::kFloat);
    at::Tensor loss_sum = at::zeros({}, hidden.options().dtype(compute));
    at::Tensor grad_hidden, grad_weight;
    if (with_gradients) {
      grad_hidden = at::empty_like(hidden);
      grad_weight = at::zeros_like(weight);
    }
    const double inv_rows = 1.0 / static_cast<double>(rows);
    const bool kernel = !tp && takes_fused_kernels(hidden);
    const at::Tensor minus_inv_rows = with_gradients && !kernel
                                          ? at::full({chunk_rows, 1}, -inv_rows, hidden.options().dtype(compute))
                                          : at::Tensor();
    for (int64_t first = 0; first < rows; first += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - first);
      const auto h = hidden.narrow(0, first, n);
      const auto target = targets.narrow(0, first, n);
      const at::Tensor logits = at::mm(h, weight.t());  // [n, vocab]
      const ChunkResult chunk =
          tp       ? chunk_over_tp(logits, target.unsqueeze(1), tp->rank() * weight.size(0), rows, minus_inv_rows,
                                   with_gradients, *tp)
          : kernel ? chunk_in_kernel(logits, target.contiguous(), rows, with_gradients)
                   : chunk_in_aten_ops(logits, target.unsqueeze(1), rows, minus_inv_rows, with_gradients);
      loss_sum += chunk.loss_sum;
      if (!with_gradients) continue;
      auto grad_rows = grad_hidden.narrow(0, first, n);
      at::mm_out(grad_rows, chunk.grad_logits, weight);
      grad_weight.addmm_(chunk.grad_logits.t(), h);
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
    return {grad_hidden.mul_(scale), grad_weight.mul_(scale), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                int64_t chunk_bytes, Communicator* tp) {
  if (hidden.dim() != 2 || weight.dim() != 2 || hidden.size(1) != weight.size(1) || targets.dim() != 1 ||
      targets.size(0) != hidden.size(0) || hidden.scalar_type() != weight.scalar_type() ||
      targets.scalar_type() != at::kLong || hidden.size(0) == 0 || targets.device() != hidden.device() ||
      weight.device() != hidden.device())
    throw std::invalid_argument(c10::str("linear_cross_entropy: hidden ", hidden.sizes(), " ", hidden.scalar_type(),
                                         ", weight ", weight.sizes(), " ", weight.scalar_type(), ", targets ",
                                         targets.sizes(), " ", targets.scalar_type(),
                                         ": need [rows > 0, dim], [vocab, dim] of one dtype and [rows] int64, on one device"));
  const int64_t chunk_rows = std::max<int64_t>(1, chunk_bytes / (weight.size(0) * int64_t(sizeof(float))));
  const int64_t chunks = (hidden.size(0) + chunk_rows - 1) / chunk_rows;
  const int64_t balanced_rows = (hidden.size(0) + chunks - 1) / chunks;  // equal chunks, not one short tail
  const bool with_gradients = c10::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  return LinearCrossEntropy::apply(hidden, weight, targets, balanced_rows, with_gradients, tp);
}

}  // namespace fsdp::model
