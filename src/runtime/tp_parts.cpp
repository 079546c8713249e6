// Where a rank's elements lie in a full parameter: its shard's rows (shard_rows_of,
// fsdp/fully_shard.h) and, for a tensor-parallel part (fsdp/tensor_parallel.h), the part's place
// in the full parameter; which parameters are parts. The collectives that move activations are the front end's
// (src/fully_shard/tp_collectives.cpp).
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "fsdp/fully_shard.h"
#include "fsdp/tensor_parallel.h"
#include "runtime/group_state.h"
#include "runtime/runtime.h"

namespace fsdp {
namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The parts by TensorImpl; an entry whose tensor died is stale (a new tensor may reuse the address).
struct Registry {
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor;
    TpPart part;
  };
  std::mutex mutex;
  std::unordered_map<const void*, Entry> parts;
  static Registry& get() {
    static Registry registry;
    return registry;
  }
};

}  // namespace

std::vector<int64_t> TpPart::part_shape() const {
  const int64_t ranks = tp->world_size();
  if (full_shape.size() != 2 || dim < 0 || dim > 1)
    throw std::invalid_argument("fsdp::TpPart: a part of a 2-D parameter along dim 0 or 1, not dim " +
                                std::to_string(dim) + " of " + shape_text(full_shape));
  int64_t along = 0, total = 0;
  for (int64_t size : sections) {
    if (size % ranks != 0)
      throw std::invalid_argument("fsdp::TpPart: a section of " + std::to_string(size) + " along dim " +
                                  std::to_string(dim) + " of " + shape_text(full_shape) + " does not split over " +
                                  std::to_string(ranks) + " tp ranks: choose a tp degree that divides it");
    along += size / ranks;
    total += size;
  }
  if (dim == 1 && sections.size() != 1)
    throw std::invalid_argument("fsdp::TpPart: a part of columns is one section of them, not " +
                                std::to_string(sections.size()));
  if (total != full_shape[dim])
    throw std::invalid_argument("fsdp::TpPart: sections summing to " + std::to_string(total) + ", not dim " +
                                std::to_string(dim) + " of " + shape_text(full_shape));
  std::vector<int64_t> shape = full_shape;
  shape[dim] = along;
  return shape;
}

at::Tensor TpPart::indices_of(int rank) const {
  const int64_t ranks = tp->world_size();
  std::vector<at::Tensor> pieces;
  int64_t start = 0;
  for (int64_t size : sections) {
    const int64_t chunk = size / ranks;
    pieces.push_back(at::arange(start + rank * chunk, start + (rank + 1) * chunk, at::kLong));
    start += size;
  }
  return at::cat(pieces);
}

at::Tensor TpPart::part_of(const at::Tensor& full) const {
  part_shape();  // checks the sections
  return full.index_select(dim, indices_of(tp->rank()).to(full.device()));
}

at::Tensor TpPart::assemble(const at::Tensor& parts) const {
  const auto shape = part_shape();
  const int64_t ranks = tp->world_size();
  std::vector<at::Tensor> order(ranks);
  for (int r = 0; r < ranks; ++r) order[r] = indices_of(r);
  // Full index of every column (or row) of the stacked parts, rank after rank; scattered back.
  const at::Tensor where = at::cat(order).to(parts.device());
  const at::Tensor stacked = dim == 0 ? parts.reshape({ranks * shape[0], shape[1]})
                                      : parts.permute({1, 0, 2}).reshape({shape[0], ranks * shape[1]});
  at::Tensor full = at::empty(full_shape, parts.options());
  return full.index_copy_(dim, where, stacked);
}

int64_t HeldElements::rows() const {
  int64_t n = 0;
  for (const auto& run : row_runs) n += run.second;
  return n;
}

int64_t ShardRows::row_numel() const {
  int64_t n = 1;
  for (size_t d = 1; d < full_shape.size(); ++d) n *= full_shape[d];
  return n;
}

ShardRows shard_rows_of(const at::Tensor& param) {
  if (auto owner = Runtime::get().owner_of(param)) {
    const ShardedParam& p = owner->state->params().sharded()[owner->index];
    const int rank = owner->state->params().comm().rank();
    return {std::min(p.layout.first_row(rank), p.layout.rows), p.layout.local_rows(rank), p.full_shape};
  }
  return {0, param.dim() == 0 ? 1 : param.size(0), param.sizes().vec()};
}

HeldElements held_elements_of(const at::Tensor& param) {
  // The rows of the tensor fully_shard sharded (the part, or the parameter) this rank holds.
  const ShardRows sharded = shard_rows_of(param);
  const int64_t first_row = sharded.first_row, rows = sharded.rows;
  const TpPart* part = tp_part_of(param);
  HeldElements held;
  held.full_shape = part ? part->full_shape : sharded.full_shape;
  held.columns = 1;
  for (size_t d = 1; d < held.full_shape.size(); ++d) held.columns *= held.full_shape[d];
  if (!part || part->dim == 1) {
    if (rows > 0) held.row_runs.emplace_back(first_row, rows);
    if (part) {
      held.columns = part->part_shape()[1];
      held.first_column = part->tp->rank() * held.columns;
    }
    return held;
  }
  // A part of rows: its rows' places in the full tensor, in runs.
  const at::Tensor index = part->indices_of(part->tp->rank()).narrow(0, first_row, rows);
  const int64_t* at_row = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    if (!held.row_runs.empty() && held.row_runs.back().first + held.row_runs.back().second == at_row[i])
      ++held.row_runs.back().second;
    else
      held.row_runs.emplace_back(at_row[i], 1);
  }
  return held;
}

void set_tp_part(const at::Tensor& param, TpPart part) {
  if (!part.tp || !part.replica)
    throw std::invalid_argument("fsdp::set_tp_part: no tp or replica communicator (make_mesh's, with tp > 1)");
  const auto shape = part.part_shape();
  if (param.sizes().vec() != shape)
    throw std::invalid_argument("fsdp::set_tp_part: the parameter is " + shape_text(param.sizes().vec()) +
                                ", but its part of " + shape_text(part.full_shape) + " is " + shape_text(shape));
  auto& registry = Registry::get();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.parts.insert_or_assign(param.unsafeGetTensorImpl(),
                                 Registry::Entry{decltype(Registry::Entry::tensor)(param.getIntrusivePtr()),
                                                 std::move(part)});
}

const TpPart* tp_part_of(const at::Tensor& param) {
  if (!param.defined()) return nullptr;
  auto& registry = Registry::get();
  std::lock_guard<std::mutex> lock(registry.mutex);
  const auto it = registry.parts.find(param.unsafeGetTensorImpl());
  if (it == registry.parts.end()) return nullptr;
  if (it->second.tensor.expired()) {
    registry.parts.erase(it);
    return nullptr;
  }
  return &it->second.part;
}

}  // namespace fsdp
