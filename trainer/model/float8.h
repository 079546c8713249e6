// Float8 linears (issue #32): y = x @ weight^T with both operands cast to 8-bit floats with
// dynamic scales, the product computed by the float8 tensor cores (at::_scaled_mm, sm_89+), and
// backward's two GEMMs in float8 too. The master weights, the gradients and the outputs keep
// their dtypes; only the GEMMs' operands are 8-bit.
//
// Recipes (the formats and scale granularity of each GEMM's operands, as torchao's):
//   tensorwise: one scale per tensor. x and weight in e4m3 (3 mantissa bits, max 448); the
//               output's gradient in e5m2 (2 mantissa bits, max 57344: gradients span a wider
//               range). Forward's GEMM accumulates with cuBLAS's fast accumulation.
//   rowwise:    one scale per row of each GEMM operand (per token, per output feature, and in
//               backward per column), everything in e4m3.
// Scales are powers of two (the largest with amax * scale <= the format's max), so scaling is exact
// and the only rounding is the 8-bit cast itself (round to nearest even, saturating).
//
// CUDA tensors go through our cast kernels (float8_kernels.cu) and at::_scaled_mm; CPU tensors
// through the ATen reference below, which computes the same casts and multiplies the dequantised
// operands in float32 (the tests' reference; _scaled_mm on CPU takes tensorwise scales only).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace fsdp::model {

enum class Float8Recipe { Off, Tensorwise, Rowwise };
Float8Recipe float8_recipe_named(const std::string& name);  // "off", "tensorwise", "rowwise"
std::string name_of(Float8Recipe recipe);

enum class Float8Format { E4M3, E5M2 };
float max_of(Float8Format format);  // 448, 57344

// An operand of a float8 GEMM: data [rows, cols] in float8, row-major, and the float32 factor
// that turns its values back into the original's: one (shape []) or one per row ([rows]).
struct Float8Operand {
  at::Tensor data;
  at::Tensor inverse_scale;
};

// The largest |element| of x [rows, cols] as float32: of all (per_row false, shape []), or of each
// row of the operand to_float8 makes (transposed false: x's rows, [rows]; true: x's columns, [cols]).
at::Tensor float8_amax(const at::Tensor& x, bool per_row, bool transposed);

// x [rows, cols] (any floating dtype) cast to `format`, as itself or transposed ([cols, rows],
// row-major: the layout _scaled_mm needs for its second operand), scaled per tensor or per row of
// the result. `amax` (float8_amax of the same arguments) may be passed when already known.
Float8Operand to_float8(const at::Tensor& x, Float8Format format, bool per_row, bool transposed,
                        const at::Tensor& amax = {});

// Both layouts of x [rows, cols] with one scale for the whole tensor, from one read of x: the
// operands tensorwise uses twice (x: forward and the weight's gradient; the output's gradient:
// both gradients).
struct Float8Layouts {
  Float8Operand plain, transposed;
};
Float8Layouts to_float8_both(const at::Tensor& x, Float8Format format, const at::Tensor& amax = {});

// a.data [m, k] @ b.data [n, k]^T, rescaled, as `out_dtype` [m, n]. `fast_accumulation`: cuBLAS's
// faster, less exact float8 accumulation (CUDA only).
at::Tensor float8_mm(const Float8Operand& a, const Float8Operand& b, at::ScalarType out_dtype,
                     bool fast_accumulation);

// x [..., in] @ weight [out, in]^T in float8 by `recipe` (not Off), differentiable in x and weight.
// On CUDA: a GPU of compute capability 8.9 or newer, in and out multiples of 16, and x's rows
// (the product of its leading sizes) a multiple of 16 (backward contracts over them).
at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, Float8Recipe recipe);

// Throws, naming the GPU and the fix, when `device` cannot run float8 GEMMs.
void check_float8_device(c10::Device device);

namespace reference {
Float8Operand to_float8(const at::Tensor& x, Float8Format format, bool per_row, bool transposed,
                        const at::Tensor& amax = {});
}  // namespace reference

}  // namespace fsdp::model
