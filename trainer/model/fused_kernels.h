// Launchers of the Llama's own CUDA kernels (fused_kernels.cu). Plain C++ types only, so the
// callers (fused_ops.cpp) need no CUDA headers and the .cu file no torch headers.
#pragma once

#include <cstdint>

#include "kernels/dtype.h"  // the library's kernel element types

namespace fsdp::kernels {

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

// Cross-entropy of each of `rows` rows of logits [rows, vocab] against targets [rows] (int64, on
// the device): row_loss[r] = log sum exp(row) - row[target] in float32 (NaN for a target outside
// [0, vocab)). Where `gradients`, each row is then overwritten with the gradient of a mean over
// `mean_over` rows, (softmax(row) - one_hot(target)) / mean_over, computed in float32 and rounded
// once to the logits' dtype.
void cross_entropy(void* logits, const int64_t* targets, float* row_loss, int64_t rows, int64_t vocab,
                   int64_t mean_over, bool gradients, Dtype dtype, void* stream);

}  // namespace fsdp::kernels
