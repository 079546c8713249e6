// Where the float8 all-gather's two ends meet: the parameter groups (src/shard), which gather the
// weights marked by enable_float8_all_gather in float8, and float8_linear, which reads them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "fsdp/float8.h"

namespace fsdp::float8 {

// out (float8 e4m3 [rows, cols], row-major) = x [rows, cols] cast with the power-of-two scale of
// `amax` (float32 [], on x's device), saturating; inverse_scale (float32 []) = 1 / that scale.
// On GPUs out must be 16-byte aligned. Runs on the current stream.
void cast_with_amax(const at::Tensor& x, const at::Tensor& amax, const at::Tensor& out,
                    const at::Tensor& inverse_scale);

// data [rows, cols] of 1-byte float8 as its transpose [cols, rows], row-major.
at::Tensor transpose(const at::Tensor& data);

// The gathered float8 copy of a marked weight, from its group's unshard to its reshard.
void set_gathered(const at::Tensor& weight, const Float8Operand& gathered);
void clear_gathered(const at::Tensor& weight);
// The copy while its group is unsharded; none for a weight not marked, or while sharded.
std::optional<Float8Operand> gathered(const at::Tensor& weight);

}  // namespace fsdp::float8
