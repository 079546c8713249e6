// The parameter-major layout the collectives use, for parameters' rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "shard/shard_layout.h"

namespace fsdp {

// Writes each of `pieces` into its slot, a parameter-major layout's slot of a tensor
// (layouts[i].padded_rows() rows of it, 1-D): its rows first, then zeros (an undefined piece:
// all zeros). Each slot holds rank r's rows of its tensor at r * shard_rows (ShardLayout), so one
// reduce-scatter per slot gives each rank its rows with no reordering. One multi-tensor copy
// casting to the slots' dtype, and one kernel for the zeros.
void parameter_major_into(const std::vector<at::Tensor>& slots, const std::vector<at::Tensor>& pieces);

// The slots of `layouts` one after another in `out` (1-D), which they fill.
std::vector<at::Tensor> slots_of(const at::Tensor& out, const std::vector<ShardLayout>& layouts);

}  // namespace fsdp
