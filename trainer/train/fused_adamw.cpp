#include "train/fused_adamw.h"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/util/StringUtil.h>

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
    state.add_sharded("adam.exp_avg." + name, s.exp_avg, param);
    state.add_sharded("adam.exp_avg_sq." + name, s.exp_avg_sq, param);
    state.add_replicated("adam.step." + name, s.step);
  }
}

at::Tensor FusedAdamW::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  for (auto& group : param_groups_)
    update(static_cast<const torch::optim::AdamWOptions&>(group.options()), group.params());
  return loss;
}

void FusedAdamW::step_params(const std::vector<at::Tensor>& params) {
  size_t found = 0;
  for (auto& group : param_groups_) {
    std::vector<at::Tensor> in_group;
    for (const auto& p : params)
      for (const auto& q : group.params())
        if (p.is_same(q)) in_group.push_back(p);
    found += in_group.size();
    if (!in_group.empty()) update(static_cast<const torch::optim::AdamWOptions&>(group.options()), in_group);
  }
  if (found != params.size())
    throw std::invalid_argument("FusedAdamW::step_params: " + std::to_string(params.size() - found) +
                                " of the parameters were not given to this optimizer");
}

void FusedAdamW::update(const torch::optim::AdamWOptions& o, const std::vector<at::Tensor>& params) {
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
    at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, l.steps, o.lr(),
                      std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                      /*amsgrad=*/false, /*maximize=*/false);
  }
}

}  // namespace fsdp::train
