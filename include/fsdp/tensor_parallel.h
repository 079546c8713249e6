// Tensor parallelism for torch::nn models under fully_shard: each layer's matrices split over the
// `tp` ranks of a Mesh (make_mesh(replicas, world, tp)), as Megatron-LM and torchtitan split them,
// with sequence parallelism between the split layers. A module keeps only its own part of each
// split parameter (declared with set_tp_part before fully_shard); fully_shard then shards that
// part over the mesh's `shard` ranks, which hold the same part. The library follows the parts
// where it handles whole parameters: full_parameter assembles the full tensor, init_normal_ gives
// a part the values of its place in the full tensor (a model is the same on any layout), and the
// gradient norm counts each part once and a replicated parameter once.
//
// A block with sequence parallelism (docs/parallelism.md), x holding this rank's rows of tokens:
//   h = x + tp::scatter_rows(attention(tp::gather_rows(norm(x), tp)), tp)
// where attention's input projection is column-parallel (its heads' rows) and its output
// projection row-parallel (those heads' columns), so its output is this rank's partial sum.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp {

/// Where a tensor-parallel part lies in its full 2-D parameter. Along `dim` the full tensor is
/// `sections` one after another (a fused projection's q, k and v rows; one section for a plain
/// split); each section is cut into tp equal chunks, and tp rank t holds chunk t of every section,
/// concatenated (torch.chunk of each section, as DTensor's Shard does).
struct TpPart {
  std::shared_ptr<Communicator> tp;  ///< the ranks holding the other parts (Mesh::tp)
  /// The ranks that hold the model once between them (Mesh::replica): a checkpoint's writers.
  std::shared_ptr<Communicator> replica;
  int64_t dim = 0;                   ///< 0: the part is rows of the full tensor (column-parallel); 1: columns
  /// Sizes along dim, summing to full_shape[dim] (along dim 1 one section: a part of columns is
  /// one range of them).
  std::vector<int64_t> sections;
  std::vector<int64_t> full_shape;   ///< the whole parameter's [rows, columns]

  /// This rank's part's shape. Throws std::invalid_argument naming the section that the tp ranks
  /// do not divide evenly.
  std::vector<int64_t> part_shape() const;
  /// The full tensor's indices along dim of tp rank `rank`'s part, in the part's order (int64).
  at::Tensor indices_of(int rank) const;
  /// This rank's part of `full` (a copy).
  at::Tensor part_of(const at::Tensor& full) const;
  /// The full tensor from every tp rank's part, stacked in rank order ([tp, part_shape]).
  at::Tensor assemble(const at::Tensor& parts) const;
};

/// Where this rank's elements of a parameter (sharded by fully_shard or not, a tp part or not) lie
/// in the full parameter: its local tensor is the full tensor's rows `row_runs` (runs of
/// consecutive rows, in order) restricted to columns [first_column, first_column + columns)
/// (every column, or a 1-D parameter's one, where it is not a part of columns).
struct HeldElements {
  std::vector<std::pair<int64_t, int64_t>> row_runs;  ///< (first row, rows), in the local tensor's order
  int64_t first_column = 0;                           ///< the first column held
  int64_t columns = 0;                                ///< columns held (the elements of a row when all)
  std::vector<int64_t> full_shape;                    ///< the whole parameter's
  int64_t rows() const;                               ///< in all runs
};
/// See HeldElements. Not collective.
HeldElements held_elements_of(const at::Tensor& param);

/// Declares that `param` (a module's parameter of part_shape(), not yet sharded) is this rank's
/// part of a larger parameter. Call it before fully_shard; a parameter without one is the same on
/// every tp rank (a norm's weight).
void set_tp_part(const at::Tensor& param, TpPart part);
/// The part `param` was declared as, or nullptr.
const TpPart* tp_part_of(const at::Tensor& param);

namespace tp {

/// The tp collectives as autograd functions (each rank calls them in the same order). Row-wise:
/// on [rows, ...] tensors, their first dimension (a model's tokens flattened), divisible by tp.
/// Identity forward; backward sums the gradient over the tp ranks (a replicated input used by
/// this rank's part: a norm's weight under sequence parallelism).
at::Tensor copy_in(const at::Tensor& x, Communicator& tp);
/// All-gathers every rank's rows (forward); backward reduce-scatters (sums) the gradient, each
/// rank keeping its rows.
at::Tensor gather_rows(const at::Tensor& x, Communicator& tp);
/// Reduce-scatters partial sums (forward): each rank keeps its rows of the sum; backward
/// all-gathers the gradient.
at::Tensor scatter_rows(const at::Tensor& x, Communicator& tp);

}  // namespace tp
}  // namespace fsdp
