// The Llama's fused elementwise operations, differentiable. CUDA tensors go through our own
// kernels (fused_kernels.cu) when the build has them; everything else, CPU included, through
// the ATen reference below, which computes the same thing: float32 arithmetic (float64 for
// float64 tensors), one rounding to the input's dtype.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp::model {

// Whether CUDA tensors use the fused kernels (built when CMake found nvcc).
bool have_fused_kernels();

// Rotary embedding applied to a fused QKV projection's output qkv [batch, seq, heads * head_dim]:
// the first `rotated_heads` heads (q, then k) have pairs (i, i + head_dim / 2) rotated by the
// angles cos/sin [seq, head_dim / 2] (float32) of their position; the other heads (v) are copied.
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t rotated_heads);

// silu(gate) * up of a fused gate/up projection's output [..., 2 * ffn] (gate first) -> [..., ffn].
at::Tensor swiglu(const at::Tensor& gate_up);

namespace reference {
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t rotated_heads);
at::Tensor swiglu(const at::Tensor& gate_up);
}  // namespace reference

}  // namespace fsdp::model
