// What the torch side of the trainer's CUDA kernels shares (builds with FSDP_WITH_CUDA_KERNELS):
// the kernels' element type of a tensor and the stream they run on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

#include "model/fused_kernels.h"

namespace fsdp::model {

// The kernels' element type for t's dtype; none for dtypes they do not take.
inline std::optional<kernels::Dtype> kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::Dtype::Float;
    case at::kBFloat16: return kernels::Dtype::BFloat16;
    case at::kHalf: return kernels::Dtype::Half;
    default: return std::nullopt;
  }
}

// The current stream of t's device, as the kernels' launchers take it.
inline void* current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace fsdp::model
