// Launchers of the Llama's own CUDA kernels (fused_kernels.cu). Plain C++ types only, so the
// callers (fused_ops.cpp) need no CUDA headers and the .cu file no torch headers.
#pragma once

#include <cstdint>

namespace fsdp::model::kernels {

enum class Dtype { Float, BFloat16, Half };

// Rotary embedding of a fused QKV projection's output: `rows` rows (batch x seq, position =
// row % seq) of `heads` heads of `head_dim` elements; the first `rotated_heads` heads (q and k)
// have pairs (i, i + head_dim / 2) rotated by the position's angle, the rest (v) are copied.
// cos/sin: float32 [seq, head_dim / 2]. inverse: rotate by minus the angle (the backward).
// Computed in float32, rounded once to the output dtype. `in` and `out` may not overlap.
void rope(const void* in, void* out, const float* cos, const float* sin, int64_t rows, int64_t seq,
          int64_t heads, int64_t rotated_heads, int64_t head_dim, bool inverse, Dtype dtype, void* stream);

// SwiGLU of a fused gate/up projection's output [rows, 2 * ffn] (gate first): out [rows, ffn] =
// silu(gate) * up, in float32, rounded once.
void swiglu_forward(const void* gate_up, void* out, int64_t rows, int64_t ffn, Dtype dtype, void* stream);
// grad_gate_up [rows, 2 * ffn] from grad_out [rows, ffn] and the forward's input.
void swiglu_backward(const void* gate_up, const void* grad_out, void* grad_gate_up, int64_t rows, int64_t ffn,
                     Dtype dtype, void* stream);

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

}  // namespace fsdp::model::kernels
