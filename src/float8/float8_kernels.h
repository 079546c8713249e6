// Launchers of the float8 CUDA kernels (float8_kernels.cu). Plain C++ types only, so the callers
// (float8.cpp, the parameter groups' float8 all-gather) need no CUDA headers and the .cu file no
// torch headers.
#pragma once

#include <cstdint>

#include "kernels/dtype.h"

namespace fsdp::kernels {

// x [rows, cols] cast to float8 (e4m3, or e5m2) with power-of-two scales, written as out [rows, cols]
// and/or, transposed, out_transposed [cols, rows] (row-major both; a null pointer skips that
// layout). Scales: the largest power of two s with amax * s <= the format's max, from amax: one
// value (per_row false) or one per row of the layout written (per_row needs exactly one layout);
// inverse_scale (as many values) gets 1 / s. Values scaled exactly, rounded to nearest even,
// saturated at the max. cols must be a multiple of 16 and x and the outputs 16-byte aligned.
void float8_cast(const void* x, Dtype dtype, int64_t rows, int64_t cols, const float* amax, bool per_row,
                 void* out, void* out_transposed, bool e5m2, float* inverse_scale, void* stream);

// The compute capability of GPU `device` as major * 10 + minor (90 for Hopper).
int compute_capability(int device);

// *amax = max(*amax, the largest |x[i]|) over x's n elements (16-byte aligned), as float32: one pass,
// one atomic per block (*amax starts at 0 or any smaller non-negative value).
void amax(const void* x, Dtype dtype, int64_t n, float* amax, void* stream);

// out [cols, rows] = in [rows, cols]^T for 1-byte elements (float8 data), row-major both. rows and
// cols must be multiples of 16, in and out 16-byte aligned.
void transpose_bytes(const void* in, void* out, int64_t rows, int64_t cols, void* stream);

}  // namespace fsdp::kernels
