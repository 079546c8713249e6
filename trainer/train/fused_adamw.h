// AdamW whose update is one fused kernel per (device, dtype) over all
// parameters instead of libtorch's ~10 kernels per parameter: on GPUs, for
// float32 parameters, the trainer's own (train/adamw_kernel.h), elsewhere
// ATen's _fused_adamw_ (the kernel behind PyTorch's `AdamW(fused=True)`).
// Same options and same arithmetic as torch::optim::AdamW (no amsgrad). On
// GPUs the gradients of float32 parameters may be bf16 (fsdp's
// keep_low_precision_grads), read as their float32 values.
#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include "fsdp/sharded_checkpoint.h"

namespace fsdp::train {

struct FusedAdamWState : torch::optim::OptimizerCloneableParamState<FusedAdamWState> {
  at::Tensor step;  // float32 scalar on the parameter's device: the kernel reads it there
  at::Tensor exp_avg, exp_avg_sq;
};

class FusedAdamW : public torch::optim::Optimizer {
 public:
  FusedAdamW(std::vector<at::Tensor> params, const torch::optim::AdamWOptions& options);
  at::Tensor step(LossClosure closure = nullptr) override;
  // A step that reads every gradient divided by `grad_divisor` (one float32 element, on any
  // device), as if the gradients had been divided first: the global-norm clip applied in the
  // update, with no pass over the gradients of its own (fsdp::grad_norm gives the norm,
  // fsdp::clip_divisor the divisor). Undefined: divided by nothing. Whether the gradients are
  // left divided afterwards is unspecified (ATen's kernel, used on CPUs, writes them back).
  void step_with_grad_divisor(const at::Tensor& grad_divisor);
  // The step of only these parameters (each with its group's options): a step in backward
  // (fsdp::set_step_in_backward). Throws std::invalid_argument for a parameter it was not given.
  void step_params(const std::vector<at::Tensor>& params);

  // Allocates the moments of every trainable parameter now rather than in the
  // first step(). Call it after sharding (the moments take the parameters'
  // current, sharded shapes) and before the first forward: the moments are the
  // largest long-lived tensors, and created in the first step they land in the
  // holes that step's activations left, where they split the free memory for
  // good (on the 1B model with checkpointing, 0.8 GiB reserved but unusable).
  void init_state();
  // Adds the moments (laid out like their parameters) and step counts (replicated) of
  // `named_params` to a sharded checkpoint, as "adam.exp_avg.NAME", ... Call after init_state().
  void add_to_checkpoint(fsdp::CheckpointState& state,
                         const std::vector<std::pair<std::string, at::Tensor>>& named_params);

 private:
  FusedAdamWState& state_of(const at::Tensor& param);
  void update(const torch::optim::AdamWOptions& options, const std::vector<at::Tensor>& params,
              const at::Tensor& grad_divisor);
  // The trainer's kernel where it takes the tensors (false: not taken); `copied` gets the
  // parameters whose kept compute shard (fsdp::compute_shard_of) it wrote too.
  static bool step_with_kernel(const torch::optim::AdamWOptions& o, const std::vector<at::Tensor>& params,
                               const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                               const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& steps,
                               const at::Tensor& grad_divisor, std::vector<at::Tensor>& copied);
  // ATen's _fused_adamw_ (CPUs, and tensors the kernel does not take).
  static void step_with_aten(const torch::optim::AdamWOptions& o, const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                             const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& steps,
                             const at::Tensor& divisor);
};

}  // namespace fsdp::train
