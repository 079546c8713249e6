// Launcher of the trainer's AdamW kernel (adamw_kernel.cu). Plain C++ types only, so its caller
// (fused_adamw.cpp) needs no CUDA headers and the .cu file no torch headers.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/dtype.h"

namespace fsdp::kernels {

// One float32 parameter's step: the parameter, its gradient (float32 or bf16: grad_dtype), both
// moments (all `numel` long, contiguous) and its step count (a float32 scalar on the device,
// already advanced); where compute_copy is not null, the updated parameter also written there in
// bf16 (`numel` long, rounded to nearest even as a cast): fsdp's kept compute shard.
struct AdamWTensor {
  float* param;
  const void* grad;
  Dtype grad_dtype;
  float* exp_avg;
  float* exp_avg_sq;
  const float* step;
  int64_t numel;
  void* compute_copy = nullptr;
};

struct AdamWHyperparameters {
  double lr, beta1, beta2, weight_decay, eps;
};

// torch's AdamW update of every tensor, in float32 with the arithmetic of ATen's fused kernel
// (`_fused_adamw_`), each gradient read divided by *grad_divisor where that is not null (the
// gradients themselves are left as they are). A bf16 gradient is read into float32 exactly, as
// if cast first. One read and one write of each of the four arrays and nothing else, where
// ATen's kernel runs at about 3.0 of the H200's 4.8 TB/s.
void adamw_step(const std::vector<AdamWTensor>& tensors, const AdamWHyperparameters& h, const float* grad_divisor,
                void* stream);

}  // namespace fsdp::kernels
