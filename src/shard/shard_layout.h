// How one parameter is cut into world-size shards along dim 0. Pure
// arithmetic, so the planning is testable without tensors.
//
// Every rank holds shard_rows() rows; rank r owns full rows
// [r * shard_rows, r * shard_rows + local_rows(r)). The last ranks may own
// fewer rows (or none, when rows < world) and are zero-padded up to
// shard_rows, so all ranks exchange equal-sized buffers.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdp {

struct ShardLayout {
  int64_t rows = 0;       // dim-0 size of the full parameter (1 for a 0-dim parameter)
  int64_t row_numel = 1;  // elements per row (product of the other dims)
  int world = 1;

  // The layout of a full tensor of `shape` over `world` ranks.
  template <class Shape>
  static ShardLayout of_shape(const Shape& shape, int world) {
    ShardLayout l;
    l.world = world;
    l.rows = shape.size() == 0 ? 1 : shape[0];
    for (size_t d = 1; d < shape.size(); ++d) l.row_numel *= shape[d];
    return l;
  }

  int64_t shard_rows() const { return (rows + world - 1) / world; }
  int64_t padded_rows() const { return shard_rows() * world; }
  int64_t shard_numel() const { return shard_rows() * row_numel; }
  int64_t first_row(int rank) const { return rank * shard_rows(); }
  int64_t local_rows(int rank) const {
    return std::clamp<int64_t>(rows - first_row(rank), 0, shard_rows());
  }
};

}  // namespace fsdp
