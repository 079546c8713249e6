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

// Packed documents as FlashAttention's variable-length kernels take them: int32 [documents + 1],
// the offsets in the flattened [batch * seq] tokens at which each document starts, then batch *
// seq. A document ends with (and includes) any id of `eos_ids`, or at its row's end.
at::Tensor document_offsets(const at::Tensor& tokens, const std::vector<int64_t>& eos_ids);
// The same as a mask: bool [batch, 1, seq, seq], true where key j <= query i lies in i's document.
at::Tensor block_causal_mask(const at::Tensor& offsets, int64_t batch, int64_t seq);

// Causal scaled-dot-product attention of q [batch, heads, seq, head_dim] over k, v [batch, kv_heads,
// seq, head_dim] (kv_heads divides heads), default scale, no dropout. With `documents`
// (document_offsets'), each query attends only to its own document: FlashAttention-2's
// variable-length kernel where it applies (CUDA sm80+, bf16/fp16, head_dim a multiple of 8 up to
// 256; grouped k/v heads too), elsewhere block_causal_mask through SDPA with k and v expanded to
// q's heads (SDPA takes a mask beside grouped heads only in its math kernel, which holds the
// [batch, heads, seq, seq] scores).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionKernel kernel,
                            const at::Tensor& documents = {});

namespace reference {
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t rotated_heads);
at::Tensor swiglu(const at::Tensor& gate_up);
}  // namespace reference

}  // namespace fsdp::model
