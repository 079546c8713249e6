// The rank-major layout collectives use, for one parameter's rows.
#pragma once

#include <ATen/core/Tensor.h>

#include "shard/shard_layout.h"

namespace fsdp {

// `rows` (the full parameter or gradient: layout.rows x layout.row_numel
// elements) as [world, shard_numel]: row r holds rank r's rows, zero-padded.
// A view when the rows divide evenly, else a padded copy.
at::Tensor rank_major(const at::Tensor& rows, const ShardLayout& layout);

}  // namespace fsdp
