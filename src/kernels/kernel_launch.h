// What the torch side of fsdp.cpp's CUDA kernels shares (builds with FSDP_WITH_CUDA_KERNELS):
// the kernels' element type of a tensor and the stream they run on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

#include "kernels/dtype.h"

namespace fsdp::kernels {

// The kernels' element type for t's dtype; none for dtypes they do not take.
inline std::optional<Dtype> kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return Dtype::Float;
    case at::kBFloat16: return Dtype::BFloat16;
    case at::kHalf: return Dtype::Half;
    default: return std::nullopt;
  }
}

// The current stream of t's device, as the kernels' launchers take it.
inline void* current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace fsdp::kernels
