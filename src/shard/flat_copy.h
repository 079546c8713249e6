// The rank-major layout collectives use, for parameters' rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace fsdp {

// Writes `rows` (full parameters or gradients of one dtype; a 0-dim tensor
// counts as one row; empty ones are skipped) into `out`, [world, sum of the shards' elements], in the
// layout of a reduce-scatter input: row r holds, for each tensor in turn,
// rank r's rows zero-padded to ceil(rows / world) (ShardLayout). One kernel casting to out's
// dtype: ATen's _chunk_cat, as PyTorch FSDP2 uses, or for one rank (nothing to pad) a
// multi-tensor copy.
void rank_major_into(at::Tensor& out, const std::vector<at::Tensor>& rows);

}  // namespace fsdp
