// One parameter of a group (FSDP2's FSDPParam): its rows on this rank, where it sits in the
// group's flat buffers, and the moves between its shard and its unsharded view. GroupParams
// (group_params.h) owns the buffers and the collectives; a ShardedParam owns what is one
// parameter's.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "shard/gather_transform.h"
#include "shard/shard_layout.h"

namespace fsdp {

struct ShardedParam {
  // Its layout over `world` ranks; `offset` is where its rows start in a rank's flat shard.
  ShardedParam(std::string name, at::Tensor param, int world, int64_t offset);

  std::string name;  // fully qualified, relative to the sharded module
  at::Tensor param;  // the module's tensor object
  std::vector<int64_t> full_shape;
  ShardLayout layout;
  int64_t offset = 0;       // element offset of this parameter in a rank's flat shard (and gradients)
  std::shared_ptr<GatherTransform> transform;  // null: gathered in the compute dtype
  int64_t gather_offset = 0; // element offset in a rank's part of its all-gather (of its kind: transformed or not)
  at::Tensor padded_shard;  // [shard_rows, ...]: this rank's rows, zero-padded (master copy)
  at::Tensor shard;         // padded_shard's real rows: what `param` holds while sharded
  at::Tensor stashed_grad;  // the sharded gradient, set aside while `param` is unsharded
  at::Tensor unsynced_grad; // full-shape gradients summed without reduce-scatter (reduce dtype)
  // ShardOptions::keep_compute_shards: the version counters of `param` and `padded_shard` when its
  // compute-dtype copy was last made from it (-1: never, or since changed).
  int64_t compute_copy_versions[2] = {-1, -1};

  bool transformed() const { return transform != nullptr; }
  // Whether its compute-dtype copy holds the master's current values.
  bool compute_copy_current() const;
  // Records that its compute-dtype copy now holds the master's values.
  void note_compute_copy_made();
  // The shape of `rows` rows of it ([rows, ...]; a 0-dim parameter is one row of one element).
  std::vector<int64_t> rows_shape(int64_t rows) const;
  // Takes this rank's rows of the full value `param` holds into `padded` (zeros past the last
  // row; the shard's storage, flat host memory when offloaded) and makes `param` hold them.
  void shard_into(at::Tensor padded, int rank);
  // Its full value inside a gathered buffer, parameter-major: its padded rows of every rank.
  at::Tensor unsharded_view(const at::Tensor& gathered) const;
  // Its full value as a view of `padded_rows`: its padded rows of every rank, flat, in rank order.
  at::Tensor full_view(const at::Tensor& padded_rows) const;
  // `param` holds `unsharded` (through its transform, if any; `compute`: its compute dtype and
  // device); the sharded gradient is set aside meanwhile.
  void point_at_unsharded(const at::Tensor& unsharded, const at::TensorOptions& compute);
  // `param` holds its shard again, with its sharded gradient.
  void point_at_shard();
  // Adds this rank's rows of a reduce-scatter output (its padded rows, flat) into its sharded
  // gradient (sets it where none exists), in its own dtype unless `keep_dtype`.
  void add_reduced_gradient(const at::Tensor& reduced, int rank, bool keep_dtype);
};

}  // namespace fsdp
