// Copies between a parameter's rows and the rank-major layout collectives use.
#pragma once

#include <ATen/core/Tensor.h>

#include "shard/shard_layout.h"

namespace fsdp {

// dst: [world, shard_numel] (may be strided along dim 0), src: the full
// parameter or gradient (layout.rows x layout.row_numel elements). Writes
// rank r's rows of src into dst[r] and zeros into the padding rows; casts to
// dst's dtype.
void scatter_rows_rank_major(const at::Tensor& dst, const at::Tensor& src,
                             const ShardLayout& layout);

}  // namespace fsdp
