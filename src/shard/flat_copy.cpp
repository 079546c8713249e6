#include "shard/flat_copy.h"

#include <ATen/ops/constant_pad_nd.h>

namespace fsdp {

at::Tensor rank_major(const at::Tensor& rows, const ShardLayout& layout) {
  at::Tensor r = rows.reshape({layout.rows, layout.row_numel});
  const int64_t padding = layout.padded_rows() - layout.rows;
  if (padding > 0) r = at::constant_pad_nd(r, {0, 0, 0, padding});
  return r.view({layout.world, layout.shard_numel()});
}

}  // namespace fsdp
