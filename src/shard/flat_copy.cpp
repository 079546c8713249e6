#include "shard/flat_copy.h"

namespace fsdp {

void scatter_rows_rank_major(const at::Tensor& dst, const at::Tensor& src,
                             const ShardLayout& layout) {
  const int64_t shard_rows = layout.shard_rows();
  if (shard_rows == 0) return;
  const int64_t rows = layout.rows, width = layout.row_numel, world = layout.world;
  at::Tensor d = dst.view({world, shard_rows, width});
  at::Tensor s = src.reshape({rows, width});
  // Ranks [0, full) are completely filled, rank `full` partly, the rest are padding.
  const int64_t full = rows / shard_rows, rest = rows - full * shard_rows;
  if (full > 0) d.narrow(0, 0, full).copy_(s.narrow(0, 0, full * shard_rows).view({full, shard_rows, width}));
  int64_t first_padding_rank = full;
  if (rest > 0) {
    d[full].narrow(0, 0, rest).copy_(s.narrow(0, full * shard_rows, rest));
    d[full].narrow(0, rest, shard_rows - rest).zero_();
    ++first_padding_rank;
  }
  if (first_padding_rank < world) d.narrow(0, first_padding_rank, world - first_padding_rank).zero_();
}

}  // namespace fsdp
