// The element types of fsdp.cpp's CUDA kernels, named without CUDA or torch headers, so that
// launchers' declarations are plain C++ and .cu files need no torch headers.
#pragma once

namespace fsdp::kernels {

enum class Dtype { Float, BFloat16, Half };

}  // namespace fsdp::kernels
