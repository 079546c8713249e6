#include "fsdp/float8.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/frexp.h>
#include <ATen/ops/ldexp.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>

#ifdef FSDP_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "float8/float8_kernels.h"
#include "kernels/kernel_launch.h"
#endif

#include "float8/gathered_weights.h"

namespace fsdp {

#ifdef FSDP_WITH_CUDA_KERNELS
using kernels::current_stream;
using kernels::kernel_dtype;
#endif

Float8Recipe float8_recipe_named(const std::string& name) {
  if (name == "off") return Float8Recipe::Off;
  if (name == "tensorwise") return Float8Recipe::Tensorwise;
  if (name == "rowwise") return Float8Recipe::Rowwise;
  throw std::invalid_argument("float8 recipe must be off, tensorwise or rowwise, not '" + name + "'");
}

std::string name_of(Float8Recipe recipe) {
  switch (recipe) {
    case Float8Recipe::Off: return "off";
    case Float8Recipe::Tensorwise: return "tensorwise";
    case Float8Recipe::Rowwise: return "rowwise";
  }
  return "?";
}

float max_of(Float8Format format) { return format == Float8Format::E4M3 ? 448.0f : 57344.0f; }

namespace {

at::ScalarType dtype_of(Float8Format format) {
  return format == Float8Format::E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

// An amax of zero (an all-zero row) still needs a finite scale.
constexpr float kSmallestAmax = 1e-12f;

void check_matrix(const at::Tensor& x, const char* what) {
  if (x.dim() != 2 || !at::isFloatingType(x.scalar_type()))
    throw std::invalid_argument(c10::str(what, ": expected a 2-D floating tensor, got ", x.sizes(), " ",
                                         x.scalar_type()));
}

}  // namespace

at::Tensor float8_amax(const at::Tensor& x, bool per_row, bool transposed) {
  check_matrix(x, "float8_amax");
#ifdef FSDP_WITH_CUDA_KERNELS
  // One tensor's amax by our kernel: one pass near the memory bandwidth (ATen's reduction ran at
  // about half of it on the H200's activations).
  if (!per_row && x.is_cuda() && x.is_contiguous() && kernel_dtype(x) &&
      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0) {
    const c10::cuda::CUDAGuard guard(x.device());
    auto amax = at::zeros({}, x.options().dtype(at::kFloat));
    kernels::amax(x.data_ptr(), *kernel_dtype(x), x.numel(), amax.data_ptr<float>(), current_stream(x));
    return amax;
  }
#endif
  if (!per_row) return at::linalg_vector_norm(x, INFINITY, at::OptionalIntArrayRef{}, false, at::kFloat);
  return at::linalg_vector_norm(x, INFINITY, at::IntArrayRef{transposed ? 0 : 1}, false, at::kFloat);
}

namespace reference {

Float8Operand to_float8(const at::Tensor& x, Float8Format format, bool per_row, bool transposed,
                        const at::Tensor& amax) {
  check_matrix(x, "to_float8");
  const float max = max_of(format);
  const auto a = (amax.defined() ? amax : float8_amax(x, per_row, transposed)).clamp_min(kSmallestAmax);
  // The largest power of two s with amax * s <= max: max / amax = m * 2^e with m in [0.5, 1).
  const auto exponent = std::get<1>(at::frexp(max / a));
  const auto scale = at::ldexp(at::ones_like(a), exponent - 1);
  // Scaled values as the cast sees them: scales apply to the operand's rows (x's columns when transposed).
  const auto operand = transposed ? x.t() : x;
  const auto scaled = operand.to(at::kFloat) * (per_row ? scale.unsqueeze(1) : scale);
  return {scaled.clamp(-max, max).to(dtype_of(format)).contiguous(), scale.reciprocal()};
}

}  // namespace reference

#ifdef FSDP_WITH_CUDA_KERNELS
namespace {

// Whether the cast kernels take x (a CUDA matrix of a dtype they know and a multiple of 16 columns).
bool kernels_take(const at::Tensor& x) {
  return x.is_cuda() && x.dim() == 2 && x.size(1) % 16 == 0 && kernel_dtype(x).has_value();
}

// Casts x with the kernels into the layouts asked for (plain, transposed or both: one scale).
Float8Layouts launch_cast(const at::Tensor& x, Float8Format format, bool per_row, bool plain, bool transposed,
                          const at::Tensor& amax) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto in = x.contiguous();
  if (reinterpret_cast<uintptr_t>(in.data_ptr()) % 16 != 0) in = in.clone();  // the kernels' 16-byte loads
  const auto a = amax.defined() ? amax.contiguous() : float8_amax(in, per_row, transposed);
  const int64_t rows = in.size(0), cols = in.size(1);
  const auto options = in.options().dtype(dtype_of(format));
  Float8Layouts out;
  const auto inverse_scale = at::empty_like(a);
  if (plain) out.plain = {at::empty({rows, cols}, options), inverse_scale};
  if (transposed) out.transposed = {at::empty({cols, rows}, options), inverse_scale};
  kernels::float8_cast(in.data_ptr(), *kernel_dtype(in), rows, cols, a.data_ptr<float>(), per_row,
                       plain ? out.plain.data.data_ptr() : nullptr,
                       transposed ? out.transposed.data.data_ptr() : nullptr, format == Float8Format::E5M2,
                       inverse_scale.data_ptr<float>(), current_stream(in));
  return out;
}

}  // namespace
#endif

Float8Operand to_float8(const at::Tensor& x, Float8Format format, bool per_row, bool transposed,
                        const at::Tensor& amax) {
#ifdef FSDP_WITH_CUDA_KERNELS
  if (kernels_take(x)) {
    auto out = launch_cast(x, format, per_row, !transposed, transposed, amax);
    return transposed ? out.transposed : out.plain;
  }
#endif
  return reference::to_float8(x, format, per_row, transposed, amax);
}

Float8Layouts to_float8_both(const at::Tensor& x, Float8Format format, const at::Tensor& amax) {
  const auto a = amax.defined() ? amax : float8_amax(x, false, false);
#ifdef FSDP_WITH_CUDA_KERNELS
  if (kernels_take(x)) return launch_cast(x, format, false, true, true, a);
#endif
  return {reference::to_float8(x, format, false, false, a), reference::to_float8(x, format, false, true, a)};
}

namespace float8 {

void cast_with_amax(const at::Tensor& x, const at::Tensor& amax, const at::Tensor& out,
                    const at::Tensor& inverse_scale) {
#ifdef FSDP_WITH_CUDA_KERNELS
  if (kernels_take(x)) {
    TORCH_INTERNAL_ASSERT(x.is_contiguous() && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && out.is_contiguous());
    const c10::cuda::CUDAGuard guard(x.device());
    kernels::float8_cast(x.data_ptr(), *kernel_dtype(x), x.size(0), x.size(1), amax.data_ptr<float>(),
                         /*per_row=*/false, out.data_ptr(), nullptr, /*e5m2=*/false,
                         inverse_scale.data_ptr<float>(), current_stream(x));
    return;
  }
#endif
  const auto cast = reference::to_float8(x, Float8Format::E4M3, false, false, amax);
  out.copy_(cast.data);
  inverse_scale.copy_(cast.inverse_scale);
}

at::Tensor transpose(const at::Tensor& data) {
#ifdef FSDP_WITH_CUDA_KERNELS
  if (data.is_cuda() && data.is_contiguous() && data.size(0) % 16 == 0 && data.size(1) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(data.data_ptr()) % 16 == 0) {
    const c10::cuda::CUDAGuard guard(data.device());
    auto out = at::empty({data.size(1), data.size(0)}, data.options());
    kernels::transpose_bytes(data.data_ptr(), out.data_ptr(), data.size(0), data.size(1), current_stream(data));
    return out;
  }
#endif
  return data.t().contiguous();
}

}  // namespace float8

at::Tensor float8_mm(const Float8Operand& a, const Float8Operand& b, at::ScalarType out_dtype,
                     bool fast_accumulation) {
  // Per-row scales as _scaled_mm takes them: a's [m, 1], b's (the columns of b^T) [1, n].
  const auto scale_a = a.inverse_scale.dim() == 0 ? a.inverse_scale : a.inverse_scale.unsqueeze(1);
  const auto scale_b = b.inverse_scale.dim() == 0 ? b.inverse_scale : b.inverse_scale.unsqueeze(0);
  if (a.data.is_cuda()) {
    // _scaled_mm writes bfloat16 (the only output its row-wise path has); other dtypes are cast after.
    const auto out = at::_scaled_mm(a.data, b.data.t(), scale_a, scale_b, std::nullopt, std::nullopt,
                                    at::kBFloat16, fast_accumulation);
    return out.to(out_dtype);
  }
  const auto dequantised_a = a.data.to(at::kFloat) * scale_a;
  const auto dequantised_b = b.data.to(at::kFloat) * scale_b.t();
  return at::mm(dequantised_a, dequantised_b.t()).to(out_dtype);
}

void check_float8_device(c10::Device device) {
  if (!device.is_cuda()) return;  // CPU tensors take the reference path
#ifdef FSDP_WITH_CUDA_KERNELS
  const int capability = kernels::compute_capability(device.index());
  if (capability < 89)
    throw std::invalid_argument(c10::str("float8 linears need float8 tensor cores (compute capability 8.9 or newer: ",
                                         "Ada, Hopper, Blackwell); GPU ", static_cast<int>(device.index()),
                                         " has ", capability / 10, ".", capability % 10,
                                         ". Train without --fp8 (bf16) on this GPU"));
#else
  throw std::invalid_argument(
      "float8 linears on GPUs need fsdp.cpp's CUDA kernels, and this build has none (CMake found no nvcc): "
      "install the CUDA toolkit and re-configure, or train without --fp8");
#endif
}

namespace {

// Whether x [rows, cols] and its float8 GEMMs take _scaled_mm's shapes (every dimension a multiple of 16).
void check_linear_shapes(const at::Tensor& x2, const at::Tensor& weight) {
  if (!x2.is_cuda()) return;
  const int64_t rows = x2.size(0), in = weight.size(1), out = weight.size(0);
  if (rows % 16 != 0 || in % 16 != 0 || out % 16 != 0)
    throw std::invalid_argument(c10::str("float8_linear: ", rows, " rows of ", in, " features into ", out,
                                         ": float8 GEMMs need every one a multiple of 16 (for the trainer: ",
                                         "batch x seq a multiple of 16)"));
}

// Forward and backward of tensorwise and rowwise float8 linears. Every GEMM is a @ b^T with a and
// b row-major float8 operands:
//   forward      y        = x [m, in]   @ (w [out, in])^T
//   grad input   grad_x   = g [m, out]  @ (w^T [in, out])^T
//   grad weight  grad_w   = g^T [out, m] @ (x^T [in, m])^T
// The weight is saved as itself (the unsharded parameter, which the runtime gathers again for
// backward: a float8 copy kept from forward would hold the whole model between the passes) and
// cast again there. Tensorwise casts x into both layouts in forward and keeps x^T in float8 (half
// the bytes of the bf16 activation), casts g into both layouts at once, and reuses the weight's
// amax; rowwise scales each GEMM's operands along another axis, so it keeps x and casts again.
// A weight gathered in float8 (enable_float8_all_gather) is used as gathered; backward keeps a
// view of the gathered copy (the runtime gathers it again into the same storage) and transposes it.
struct Float8LinearFunction : torch::autograd::Function<Float8LinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            int64_t recipe_index) {
    const bool rowwise = static_cast<Float8Recipe>(recipe_index) == Float8Recipe::Rowwise;
    const auto x2 = x.reshape({-1, x.size(-1)});
    check_linear_shapes(x2, weight);
    const auto gathered = float8::gathered(weight);
    if (gathered && rowwise)
      throw std::invalid_argument("float8_linear: this weight is gathered in float8 (enable_float8_all_gather), "
                                  "which only the tensorwise recipe reads: use tensorwise, or do not enable it");
    ctx->saved_data["rowwise"] = rowwise;
    at::Tensor y;
    if (rowwise) {
      y = float8_mm(to_float8(x2, Float8Format::E4M3, true, false), to_float8(weight, Float8Format::E4M3, true, false),
                    x.scalar_type(), /*fast_accumulation=*/false);
      ctx->save_for_backward({x2, weight});
    } else {
      ctx->save_for_backward({weight});
      Float8Operand w;
      if (gathered) {
        w = *gathered;
        ctx->saved_data["w"] = w.data;
        ctx->saved_data["w_inverse_scale"] = w.inverse_scale;
      } else {
        const auto w_amax = float8_amax(weight, false, false);
        w = to_float8(weight, Float8Format::E4M3, false, false, w_amax);
        ctx->saved_data["w_amax"] = w_amax;
      }
      const auto xs = to_float8_both(x2, Float8Format::E4M3);
      y = float8_mm(xs.plain, w, x.scalar_type(), /*fast_accumulation=*/true);
      ctx->saved_data["x_t"] = xs.transposed.data;
      ctx->saved_data["x_t_inverse_scale"] = xs.transposed.inverse_scale;
    }
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return y.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& d = ctx->saved_data;
    const auto saved = ctx->get_saved_variables();
    const auto& weight = saved.back();
    const auto g = grads[0].reshape({-1, weight.size(0)}).contiguous();
    const auto x_dtype = grads[0].scalar_type();  // forward's output took x's dtype
    at::Tensor grad_x, grad_w;
    if (d["rowwise"].toBool()) {
      const auto& x2 = saved[0];
      grad_x = float8_mm(to_float8(g, Float8Format::E4M3, true, false), to_float8(weight, Float8Format::E4M3, true, true),
                         x_dtype, false);
      grad_w = float8_mm(to_float8(g, Float8Format::E4M3, true, true), to_float8(x2, Float8Format::E4M3, true, true),
                         weight.scalar_type(), false);
    } else {
      const auto gs = to_float8_both(g, Float8Format::E5M2);
      const Float8Operand x_t{d["x_t"].toTensor(), d["x_t_inverse_scale"].toTensor()};
      const Float8Operand w_t = d.count("w") ? Float8Operand{float8::transpose(d["w"].toTensor()),
                                                             d["w_inverse_scale"].toTensor()}
                                             : to_float8(weight, Float8Format::E4M3, false, true, d["w_amax"].toTensor());
      grad_x = float8_mm(gs.plain, w_t, x_dtype, false);
      grad_w = float8_mm(gs.transposed, x_t, weight.scalar_type(), false);
    }
    auto sizes = grads[0].sizes().vec();
    sizes.back() = weight.size(1);
    return {grad_x.view(sizes), grad_w, at::Tensor()};
  }
};

}  // namespace

at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, Float8Recipe recipe) {
  if (recipe == Float8Recipe::Off) throw std::invalid_argument("float8_linear: recipe is off (use linear)");
  if (weight.dim() != 2 || x.dim() < 1 || x.size(-1) != weight.size(1))
    throw std::invalid_argument(c10::str("float8_linear: x ", x.sizes(), " and weight ", weight.sizes(),
                                         " do not multiply (weight [out, in], x [..., in])"));
  return Float8LinearFunction::apply(x, weight, static_cast<int64_t>(recipe));
}

}  // namespace fsdp
