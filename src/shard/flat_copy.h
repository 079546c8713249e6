// The parameter-major layout the collectives use, for parameters' rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "shard/shard_layout.h"

namespace fsdp {

// Writes `pieces` into `out` (1-D) one after another, piece i into a slot of
// layouts[i].padded_rows() rows: its rows first, then zeros (an undefined piece: all zeros). Each
// slot holds rank r's rows of its tensor at r * shard_rows (ShardLayout), so one reduce-scatter
// per slot gives each rank its rows with no reordering. One multi-tensor copy casting to out's
// dtype, and one kernel for the zeros.
void parameter_major_into(const at::Tensor& out, const std::vector<at::Tensor>& pieces,
                          const std::vector<ShardLayout>& layouts);

}  // namespace fsdp
