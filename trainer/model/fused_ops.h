// The Llama's fused elementwise operations, differentiable. CUDA tensors go through our own
// kernels (fused_kernels.cu) when the build has them; everything else, CPU included, through
// the ATen reference below, which computes the same thing: float32 arithmetic (float64 for
// float64 tensors), one rounding to the input's dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace fsdp::model {

// Whether CUDA tensors use the fused kernels (built when CMake found nvcc).
bool have_fused_kernels();
// Whether the fused kernels take `t`: a CUDA tensor of a dtype they have, in a build with them.
bool takes_fused_kernels(const at::Tensor& t);

// Rotary embedding applied to a fused QKV projection's output qkv [batch, seq, heads * head_dim]:
// the first `rotated_heads` heads (q, then k) have pairs (i, i + head_dim / 2) rotated by the
// angles cos/sin [seq, head_dim / 2] (float32) of their position; the other heads (v) are copied.
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t rotated_heads);

// silu(gate) * up of a fused gate/up projection's output [..., 2 * ffn] (gate first) -> [..., ffn].
at::Tensor swiglu(const at::Tensor& gate_up);

// Which kernel causal_attention asks for. Aten: ATen's choice (cuDNN on Hopper with torch 2.11).
// Flash: FlashAttention-2 where it takes the inputs (CUDA sm80+, bf16/fp16, head_dim a multiple of
// 8 up to 256, as many k/v heads as q heads), ATen's choice elsewhere. ATen's choice is the
// default: on H200 cuDNN is 1.6-1.9x faster than flash at head_dim 128, and at 64 neither won
// twice in a row (bench/sdpa_backends.py measures it; docs/results.md).
enum class AttentionKernel { Aten, Flash };
AttentionKernel attention_kernel_named(const std::string& name);  // "aten", "flash"

// Causal scaled-dot-product attention of q [batch, heads, seq, head_dim] over k, v [batch, kv_heads,
// seq, head_dim] (kv_heads divides heads), default scale, no dropout. With `allowed` (bool [batch,
// 1, seq, seq], true where a query attends a key, causality included) that mask instead.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionKernel kernel,
                            const at::Tensor& allowed = {});

namespace reference {
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t rotated_heads);
at::Tensor swiglu(const at::Tensor& gate_up);
}  // namespace reference

}  // namespace fsdp::model
