#include "model/fused_ops.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <stdexcept>
#include <string>

#ifdef FSDP_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/kernel_launch.h"
#include "model/fused_kernels.h"
#endif

namespace fsdp::model {

namespace reference {
namespace {
// float32 for 16-bit dtypes, float64 for float64.
at::ScalarType compute_type(const at::Tensor& t) { return c10::promoteTypes(t.scalar_type(), at::kFloat); }
}  // namespace

at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t rotated_heads) {
  const int64_t b = qkv.size(0), t = qkv.size(1), d = qkv.size(2) / heads, half = d / 2;
  const auto x = qkv.view({b, t, heads, d});
  const auto rotated = x.narrow(2, 0, rotated_heads).to(compute_type(qkv));
  const auto x1 = rotated.narrow(-1, 0, half), x2 = rotated.narrow(-1, half, half);
  const auto c = cos.view({1, t, 1, half}), s = sin.view({1, t, 1, half});
  const auto out = at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1).to(qkv.scalar_type());
  return at::cat({out, x.narrow(2, rotated_heads, heads - rotated_heads)}, 2).view(qkv.sizes());
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  const int64_t ffn = gate_up.size(-1) / 2;
  const auto type = compute_type(gate_up);
  const auto gate = gate_up.narrow(-1, 0, ffn).to(type), up = gate_up.narrow(-1, ffn, ffn).to(type);
  return (at::silu(gate) * up).to(gate_up.scalar_type());
}

}  // namespace reference

namespace {

void check_rope_shapes(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                       int64_t rotated_heads) {
  const bool qkv_ok = qkv.dim() == 3 && heads >= 1 && qkv.size(2) % heads == 0 && (qkv.size(2) / heads) % 2 == 0 &&
                      rotated_heads >= 0 && rotated_heads <= heads;
  const bool angles_ok = qkv_ok && cos.dim() == 2 && cos.size(0) == qkv.size(1) &&
                         cos.size(1) * 2 == qkv.size(2) / heads && sin.sizes() == cos.sizes() &&
                         cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                         cos.device() == qkv.device() && sin.device() == qkv.device();
  if (!angles_ok)
    throw std::invalid_argument(c10::str("rope_qkv: qkv ", qkv.sizes(), " must be [batch, seq, heads * head_dim] with ",
                                         heads, " heads of even head_dim (", rotated_heads, " rotated), and cos/sin ",
                                         cos.sizes(), " float32 [seq, head_dim / 2] on its device"));
}

#ifdef FSDP_WITH_CUDA_KERNELS

using kernels::current_stream;
using kernels::kernel_dtype;

// Rotation is orthogonal: the backward rotates the gradient by minus the angle.
at::Tensor launch_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                       int64_t rotated_heads, bool inverse) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto in = x.contiguous();
  auto out = at::empty_like(in);
  kernels::rope(in.data_ptr(), out.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), in.size(0) * in.size(1),
                in.size(1), heads, rotated_heads, in.size(2) / heads, inverse, *kernel_dtype(in), current_stream(in));
  return out;
}

struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t heads, int64_t rotated_heads) {
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["rotated_heads"] = rotated_heads;
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    return launch_rope(qkv, cos, sin, heads, rotated_heads, /*inverse=*/false);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& d = ctx->saved_data;
    return {launch_rope(grads[0], d.at("cos").toTensor(), d.at("sin").toTensor(), d.at("heads").toInt(),
                        d.at("rotated_heads").toInt(), /*inverse=*/true),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Rows of gate/up pairs (gate_up is non-empty when the kernels run).
int64_t swiglu_rows(const at::Tensor& gate_up) { return gate_up.numel() / gate_up.size(-1); }

struct SwigluFunction : torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    const c10::cuda::CUDAGuard guard(gate_up.device());
    const auto in = gate_up.contiguous();
    const int64_t ffn = in.size(-1) / 2;
    auto sizes = in.sizes().vec();
    sizes.back() = ffn;
    auto out = at::empty(sizes, in.options());
    kernels::swiglu_forward(in.data_ptr(), out.data_ptr(), swiglu_rows(in), ffn, *kernel_dtype(in), current_stream(in));
    ctx->save_for_backward({in});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto in = ctx->get_saved_variables()[0];
    const c10::cuda::CUDAGuard guard(in.device());
    const auto grad_out = grads[0].contiguous();
    auto grad_in = at::empty_like(in);
    const int64_t ffn = in.size(-1) / 2;
    kernels::swiglu_backward(in.data_ptr(), grad_out.data_ptr(), grad_in.data_ptr(), swiglu_rows(in), ffn,
                             *kernel_dtype(in), current_stream(in));
    return {grad_in};
  }
};

#endif

// Whether `kernel` sends these inputs to FlashAttention (see AttentionKernel). Builds without our
// CUDA kernels never do: ATen picks.
// Where FlashAttention-2's kernels take q: CUDA sm80+, bf16 or fp16, head_dim a multiple of 8 up to 256.
bool flash_takes(const at::Tensor& q) {
#ifdef FSDP_WITH_CUDA_KERNELS
  const int64_t head_dim = q.size(-1);
  const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  return q.is_cuda() && half && head_dim % 8 == 0 && head_dim <= 256 &&
         at::cuda::getDeviceProperties(q.device().index())->major >= 8;
#else
  (void)q;
  return false;
#endif
}

// SDPA's flash entry takes as many k/v heads as q heads only.
bool use_flash(AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k) {
  return kernel == AttentionKernel::Flash && k.size(1) == q.size(1) && flash_takes(q);
}

}  // namespace

AttentionKernel attention_kernel_named(const std::string& name) {
  if (name == "aten") return AttentionKernel::Aten;
  if (name == "flash") return AttentionKernel::Flash;
  throw std::invalid_argument("attention kernel must be aten or flash, not '" + name + "'");
}

at::Tensor document_offsets(const at::Tensor& tokens, const std::vector<int64_t>& eos_ids) {
  auto ends = at::zeros_like(tokens, at::kBool);
  for (int64_t id : eos_ids) ends |= tokens == id;
  ends.select(1, tokens.size(1) - 1).fill_(true);  // a row's end ends its last document
  const auto after_each = ends.flatten().nonzero().flatten() + 1;  // a host wait on CUDA: sizes the result
  return at::cat({at::zeros({1}, after_each.options()), after_each}).to(at::kInt);
}

at::Tensor block_causal_mask(const at::Tensor& offsets, int64_t batch, int64_t seq) {
  const auto positions = at::arange(batch * seq, offsets.options());
  // A position's document: how many documents end at or before it.
  const auto document = at::searchsorted(offsets.slice(0, 1), positions, /*out_int32=*/false, /*right=*/true)
                            .view({batch, seq});
  const auto causal = at::ones({seq, seq}, offsets.options().dtype(at::kBool)).tril();
  return (document.unsqueeze(2) == document.unsqueeze(1)).logical_and(causal).unsqueeze(1);
}

namespace {

// Packed documents: see causal_attention.
at::Tensor document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents) {
  const int64_t b = q.size(0), heads = q.size(1), t = q.size(2), d = q.size(3), kv = k.size(1);
  if (flash_takes(q)) {  // the variable-length kernel takes grouped k/v heads
    // [b, heads, t, d] views of [b, t, heads, d] -> [b * t, heads, d], the kernel's layout. The
    // longest document is at most t: an upper bound sizes the kernel's grid as well (no host wait).
    const auto tokens_first = [&](const at::Tensor& x) { return x.transpose(1, 2).reshape({b * t, x.size(1), d}); };
    const auto out = std::get<0>(at::_flash_attention_forward(tokens_first(q), tokens_first(k), tokens_first(v),
                                                              documents, documents, t, t, /*dropout_p=*/0.0,
                                                              /*is_causal=*/true, /*return_debug_mask=*/false));
    return out.view({b, t, heads, d}).transpose(1, 2);
  }
  const int64_t group = heads / kv;
  const auto as_q = [&](const at::Tensor& x) {
    return group == 1 ? x : x.unsqueeze(2).expand({b, kv, group, t, d}).reshape({b, heads, t, d});
  };
  return at::scaled_dot_product_attention(q, as_q(k), as_q(v), block_causal_mask(documents, b, t), /*dropout_p=*/0.0,
                                          /*is_causal=*/false);
}

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionKernel kernel,
                            const at::Tensor& documents) {
  if (documents.defined()) return document_attention(q, k, v, documents);
  if (use_flash(kernel, q, k))
    return std::get<0>(at::_scaled_dot_product_flash_attention(q, k, v, /*dropout_p=*/0.0, /*is_causal=*/true));
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
                                          /*scale=*/std::nullopt, /*enable_gqa=*/k.size(1) != q.size(1));
}

bool have_fused_kernels() {
#ifdef FSDP_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

bool takes_fused_kernels(const at::Tensor& t) {
#ifdef FSDP_WITH_CUDA_KERNELS
  return t.is_cuda() && kernels::kernel_dtype(t).has_value();
#else
  return false;
#endif
}

at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t rotated_heads) {
  check_rope_shapes(qkv, cos, sin, heads, rotated_heads);
#ifdef FSDP_WITH_CUDA_KERNELS
  if (takes_fused_kernels(qkv)) return RopeFunction::apply(qkv, cos.contiguous(), sin.contiguous(), heads, rotated_heads);
#endif
  return reference::rope_qkv(qkv, cos, sin, heads, rotated_heads);
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  if (gate_up.dim() < 1 || gate_up.size(-1) % 2 != 0)
    throw std::invalid_argument("swiglu: the last dimension must hold gate and up, two equal halves");
#ifdef FSDP_WITH_CUDA_KERNELS
  if (takes_fused_kernels(gate_up) && gate_up.numel() > 0) return SwigluFunction::apply(gate_up);
#endif
  return reference::swiglu(gate_up);
}

}  // namespace fsdp::model
