// Float8 linears: y = x @ weight^T with both operands cast to 8-bit floats with
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
// CUDA tensors go through our cast kernels (src/float8/float8_kernels.cu) and at::_scaled_mm; CPU
// tensors through the ATen reference below, which computes the same casts and multiplies the
// dequantised operands in float32 (the tests' reference; _scaled_mm on CPU takes tensorwise scales
// only).
//
// Any module's linear layer can call float8_linear in place of torch::nn::functional::linear; the
// trainer's Llama does for its blocks' projections (fsdp-train --fp8). Float8 all-gather
// (enable_float8_all_gather) gathers such a weight in float8 too: half the bytes of bf16.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace fsdp {

/// The formats and scale granularity of a float8 linear's GEMM operands (see the file's comment).
enum class Float8Recipe {
  Off,         ///< no float8: torch::nn::functional::linear
  Tensorwise,  ///< one scale per tensor; e4m3 x and weight, e5m2 output gradient
  Rowwise,     ///< one scale per row of each GEMM operand; e4m3 everywhere
};
/// The recipe named "off", "tensorwise" or "rowwise"; throws std::invalid_argument otherwise.
Float8Recipe float8_recipe_named(const std::string& name);
/// "off", "tensorwise" or "rowwise".
std::string name_of(Float8Recipe recipe);

/// An 8-bit floating point format.
enum class Float8Format {
  E4M3,  ///< 4 exponent and 3 mantissa bits, largest 448 (torch's float8_e4m3fn)
  E5M2,  ///< 5 exponent and 2 mantissa bits, largest 57344 (torch's float8_e5m2)
};
/// The largest finite value of `format`: 448 or 57344.
float max_of(Float8Format format);

/// An operand of a float8 GEMM.
struct Float8Operand {
  at::Tensor data;           ///< [rows, cols] in float8, row-major
  at::Tensor inverse_scale;  ///< float32 factor back to the original's values: one ([]) or one per row ([rows])
};

/// The largest |element| of x [rows, cols] as float32: of all (per_row false, shape []), or of each
/// row of the operand to_float8 makes (transposed false: x's rows, [rows]; true: x's columns, [cols]).
at::Tensor float8_amax(const at::Tensor& x, bool per_row, bool transposed);

/// x [rows, cols] (any floating dtype) cast to `format`, as itself or transposed ([cols, rows],
/// row-major: the layout _scaled_mm needs for its second operand), scaled per tensor or per row of
/// the result. `amax` (float8_amax of the same arguments) may be passed when already known.
Float8Operand to_float8(const at::Tensor& x, Float8Format format, bool per_row, bool transposed,
                        const at::Tensor& amax = {});

/// Both layouts of a tensor cast with one scale (to_float8_both).
struct Float8Layouts {
  Float8Operand plain;       ///< [rows, cols]
  Float8Operand transposed;  ///< [cols, rows]
};
/// Both layouts of x [rows, cols] with one scale for the whole tensor, from one read of x: the
/// operands tensorwise uses twice (x: forward and the weight's gradient; the output's gradient:
/// both gradients).
Float8Layouts to_float8_both(const at::Tensor& x, Float8Format format, const at::Tensor& amax = {});

/// a.data [m, k] @ b.data [n, k]^T, rescaled, as `out_dtype` [m, n]. `fast_accumulation`: cuBLAS's
/// faster, less exact float8 accumulation (CUDA only).
at::Tensor float8_mm(const Float8Operand& a, const Float8Operand& b, at::ScalarType out_dtype,
                     bool fast_accumulation);

/// x [..., in] @ weight [out, in]^T in float8 by `recipe` (not Off), differentiable in x and weight:
/// a drop-in for torch::nn::functional::linear(x, weight) in any module. On CUDA: a GPU of compute
/// capability 8.9 or newer, in and out multiples of 16, and x's rows (the product of its leading
/// sizes) a multiple of 16 (backward contracts over them).
at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, Float8Recipe recipe);

/// Throws, naming the GPU and the fix, when `device` cannot run float8 GEMMs.
void check_float8_device(c10::Device device);

/// Float8 all-gather (torchao's enable_fsdp_float8_all_gather) for `weight`: a 2-D parameter that
/// only float8_linear with the tensorwise recipe reads. Call before fully_shard shards it. Its
/// group then all-gathers it as float8 e4m3 (one byte per element instead of bf16's two) with one
/// power-of-two scale from the weight's amax over all ranks (one small all-gather for all such
/// weights of a root, at the start of each forward of the root: after the optimizer step), and
/// float8_linear reads the gathered float8 weight directly: no weight cast in forward, a float8
/// transpose in backward. The parameter's own unsharded value is not materialised: while its group
/// is unsharded it reads as NaN of its shape (a reader other than float8_linear gets a NaN loss,
/// not a plausible wrong one), so nothing but float8_linear may read it (rowwise throws). Every
/// rank must mark the same weights (fully_shard checks). Gradients, the sharded master weight and
/// the optimizer are unchanged. On GPUs the weight's columns must be a multiple of 16; groups with
/// cpu_offload cannot take it.
void enable_float8_all_gather(const at::Tensor& weight);
/// Whether enable_float8_all_gather was called on `weight` (the same tensor object).
bool float8_all_gather_enabled(const at::Tensor& weight);

/// The ATen reference of the casts (CPU ranks, and the tests' reference on GPUs).
namespace reference {
/// to_float8 computed with ATen operations.
Float8Operand to_float8(const at::Tensor& x, Float8Format format, bool per_row, bool transposed,
                        const at::Tensor& amax = {});
}  // namespace reference

}  // namespace fsdp
