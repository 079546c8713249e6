// AdamW whose update is one fused kernel per (device, dtype) over all
// parameters (ATen's _fused_adamw_, the kernel behind PyTorch's
// `AdamW(fused=True)`), instead of libtorch's ~10 kernels per parameter.
// Same options and same arithmetic as torch::optim::AdamW (no amsgrad).
#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

namespace fsdp::train {

struct FusedAdamWState : torch::optim::OptimizerCloneableParamState<FusedAdamWState> {
  at::Tensor step;  // float32 scalar on the parameter's device: the kernel reads it there
  at::Tensor exp_avg, exp_avg_sq;
};

class FusedAdamW : public torch::optim::Optimizer {
 public:
  FusedAdamW(std::vector<at::Tensor> params, const torch::optim::AdamWOptions& options);
  at::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace fsdp::train
