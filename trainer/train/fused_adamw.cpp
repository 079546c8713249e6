#include "train/fused_adamw.h"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/StringUtil.h>

#include "fsdp/group.h"

#ifdef FSDP_WITH_CUDA_KERNELS
#include "kernels/kernel_launch.h"
#include "train/adamw_kernel.h"
#endif

#include <map>
#include <stdexcept>
#include <string>

namespace fsdp::train {

FusedAdamW::FusedAdamW(std::vector<at::Tensor> params, const torch::optim::AdamWOptions& options)
    : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                std::make_unique<torch::optim::AdamWOptions>(options)) {
  if (options.amsgrad()) throw std::invalid_argument("FusedAdamW: amsgrad is not supported");
}

FusedAdamWState& FusedAdamW::state_of(const at::Tensor& param) {
  auto& slot = state_[param.unsafeGetTensorImpl()];
  if (!slot) {
    auto s = std::make_unique<FusedAdamWState>();
    s->step = at::zeros({}, param.options().dtype(at::kFloat));
    s->exp_avg = at::zeros_like(param, at::MemoryFormat::Preserve);
    s->exp_avg_sq = at::zeros_like(param, at::MemoryFormat::Preserve);
    slot = std::move(s);
  }
  return static_cast<FusedAdamWState&>(*slot);
}

void FusedAdamW::init_state() {
  at::NoGradGuard no_grad;
  for (auto& group : param_groups_)
    for (auto& p : group.params())
      if (p.requires_grad() && p.numel() > 0) state_of(p);
}

void FusedAdamW::add_to_checkpoint(fsdp::CheckpointState& state,
                                   const std::vector<std::pair<std::string, at::Tensor>>& named_params) {
  for (const auto& [name, param] : named_params) {
    auto it = state_.find(param.unsafeGetTensorImpl());
    if (it == state_.end()) continue;  // frozen or empty: no state
    auto& s = static_cast<FusedAdamWState&>(*it->second);
    const std::string adam = kAdamPrefix;
    state.add_sharded(adam + "exp_avg." + name, s.exp_avg, param);
    state.add_sharded(adam + "exp_avg_sq." + name, s.exp_avg_sq, param);
    state.add_replicated(adam + "step." + name, s.step);
  }
}

at::Tensor FusedAdamW::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  step_with_grad_divisor(at::Tensor());
  return loss;
}

void FusedAdamW::step_with_grad_divisor(const at::Tensor& grad_divisor) {
  if (grad_divisor.defined() && (grad_divisor.numel() != 1 || grad_divisor.scalar_type() != at::kFloat))
    throw std::invalid_argument("FusedAdamW: the gradient divisor must be one float32 element, not " +
                                c10::str(grad_divisor.sizes()) + " " + c10::toString(grad_divisor.scalar_type()));
  for (auto& group : param_groups_)
    update(static_cast<const torch::optim::AdamWOptions&>(group.options()), group.params(), grad_divisor);
}

void FusedAdamW::step_params(const std::vector<at::Tensor>& params) {
  size_t found = 0;
  for (auto& group : param_groups_) {
    std::vector<at::Tensor> in_group;
    for (const auto& p : params)
      for (const auto& q : group.params())
        if (p.is_same(q)) in_group.push_back(p);
    found += in_group.size();
    if (!in_group.empty()) update(static_cast<const torch::optim::AdamWOptions&>(group.options()), in_group, {});
  }
  if (found != params.size())
    throw std::invalid_argument("FusedAdamW::step_params: " + std::to_string(params.size() - found) +
                                " of the parameters were not given to this optimizer");
}

void FusedAdamW::update(const torch::optim::AdamWOptions& o, const std::vector<at::Tensor>& params,
                        const at::Tensor& grad_divisor) {
  at::NoGradGuard no_grad;
  struct Lists {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  };
  // The kernel takes tensors of one device and dtype at a time.
  std::map<std::pair<std::string, at::ScalarType>, Lists> batches;
  for (auto& p : params) {
    if (!p.grad().defined() || p.numel() == 0) continue;
    auto& s = state_of(p);
    if (!s.exp_avg.sizes().equals(p.sizes()))
      throw std::invalid_argument(
          "FusedAdamW: a parameter of shape " + c10::str(p.sizes()) + " has moments of shape " +
          c10::str(s.exp_avg.sizes()) + ": its state was created before the parameter changed shape "
          "(fully_shard after init_state() or after a step); create the state after sharding");
    auto& lists = batches[{p.device().str(), p.scalar_type()}];
    lists.params.push_back(p);
    lists.grads.push_back(p.grad());
    lists.exp_avgs.push_back(s.exp_avg);
    lists.exp_avg_sqs.push_back(s.exp_avg_sq);
    lists.steps.push_back(s.step);
  }
  for (auto& [key, l] : batches) {
    at::_foreach_add_(l.steps, 1);
    const at::Tensor divisor = grad_divisor.defined() ? grad_divisor.to(l.params.front().device()) : at::Tensor();
    std::vector<at::Tensor> copied;  // those whose kept compute shard the kernel wrote too
    if (!step_with_kernel(o, l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.steps, divisor, copied))
      step_with_aten(o, l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.steps, divisor);
    // Neither step moves the parameters' version counters (the kernel writes through pointers,
    // ATen's _fused_adamw_ does not count): moved here, so fsdp casts a kept compute shard again;
    // then the copies the kernel wrote are current.
    for (const at::Tensor& p : l.params) p.unsafeGetTensorImpl()->bump_version();
    if (!copied.empty()) fsdp::mark_compute_shards_written(copied);
  }
}

void FusedAdamW::step_with_aten(const torch::optim::AdamWOptions& o, const std::vector<at::Tensor>& params,
                                const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                                const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& steps,
                                const at::Tensor& divisor) {
  for (size_t i = 0; i < params.size(); ++i)
    if (grads[i].scalar_type() != params[i].scalar_type())
      throw std::invalid_argument(std::string("FusedAdamW: a ") + c10::toString(grads[i].scalar_type()) +
                                  " gradient of a " + c10::toString(params[i].scalar_type()) +
                                  " parameter needs the GPU kernel (contiguous float32 parameters on a GPU "
                                  "with float32 or bf16 gradients); elsewhere give gradients of the parameters' dtype");
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, o.lr(),
                    std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                    /*amsgrad=*/false, /*maximize=*/false, divisor.defined() ? std::optional(divisor) : std::nullopt);
}

// Float32 contiguous tensors on a GPU, the gradients float32 or bf16 (fsdp's
// keep_low_precision_grads): the trainer's AdamW kernel (train/adamw_kernel.h), which runs near
// the memory bandwidth where ATen's fused kernel does not. False: not taken.
bool FusedAdamW::step_with_kernel(const torch::optim::AdamWOptions& o, const std::vector<at::Tensor>& params,
                                  const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                                  const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& steps,
                                  const at::Tensor& grad_divisor, std::vector<at::Tensor>& copied) {
#ifdef FSDP_WITH_CUDA_KERNELS
  const auto takes = [](const at::Tensor& t, bool or_bf16 = false) {
    return t.is_cuda() && t.is_contiguous() &&
           (t.scalar_type() == at::kFloat || (or_bf16 && t.scalar_type() == at::kBFloat16));
  };
  for (size_t i = 0; i < params.size(); ++i)
    if (!takes(params[i]) || !takes(grads[i], /*or_bf16=*/true) || !takes(exp_avgs[i]) || !takes(exp_avg_sqs[i]) ||
        !takes(steps[i]))
      return false;
  const c10::DeviceGuard on_device(params.front().device());
  std::vector<kernels::AdamWTensor> tensors;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor copy = fsdp::compute_shard_of(params[i]);
    const bool writes_copy = copy.defined() && copy.scalar_type() == at::kBFloat16 && copy.is_contiguous();
    if (writes_copy) copied.push_back(params[i]);
    tensors.push_back({params[i].data_ptr<float>(), grads[i].const_data_ptr(),
                       grads[i].scalar_type() == at::kBFloat16 ? kernels::Dtype::BFloat16 : kernels::Dtype::Float,
                       exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(), steps[i].data_ptr<float>(),
                       params[i].numel(), writes_copy ? copy.data_ptr() : nullptr});
  }
  kernels::adamw_step(tensors, {o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps()},
                      grad_divisor.defined() ? grad_divisor.data_ptr<float>() : nullptr,
                      kernels::current_stream(params.front()));
  return true;
#else
  (void)copied;
  return false;
#endif
}

}  // namespace fsdp::train
