#include "shard/sharded_param.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "comm/tensor_alias.h"

namespace fsdp {

ShardedParam::ShardedParam(std::string name_, at::Tensor param_, int world, int64_t offset_)
    : name(std::move(name_)),
      param(std::move(param_)),
      full_shape(param.sizes().vec()),
      layout(ShardLayout::of_shape(param.sizes(), world)),
      offset(offset_) {}

std::vector<int64_t> ShardedParam::rows_shape(int64_t rows) const {
  std::vector<int64_t> shape = full_shape.empty() ? std::vector<int64_t>{1} : full_shape;
  shape[0] = rows;
  return shape;
}

void ShardedParam::shard_into(at::Tensor padded, int rank) {
  padded_shard = std::move(padded);
  const int64_t local = layout.local_rows(rank);
  shard = padded_shard.narrow(0, 0, local);
  // A rank past the last row owns none (start clamped so narrow accepts it).
  const int64_t first = std::min(layout.first_row(rank), layout.rows);
  shard.copy_(param.reshape(rows_shape(layout.rows)).narrow(0, first, local));
  if (param.grad().defined())
    throw std::invalid_argument("fsdp::fully_shard: parameter '" + name +
                                "' already has a gradient: call zero_grad() (set_to_none) or "
                                "shard before the first backward");
  param.set_data(shard);
}

// Parameter-major: its padded rows take world * shard_numel consecutive elements, so its real rows
// are a contiguous view.
at::Tensor ShardedParam::unsharded_view(const at::Tensor& gathered) const {
  return full_view(gathered.narrow(0, gather_offset * layout.world, layout.shard_numel() * layout.world));
}

at::Tensor ShardedParam::full_view(const at::Tensor& padded_rows) const {
  return padded_rows.view(rows_shape(layout.padded_rows())).narrow(0, 0, layout.rows).view(full_shape);
}

void ShardedParam::point_at_unsharded(const at::Tensor& unsharded, const at::TensorOptions& compute) {
  stashed_grad = param.grad();
  param.mutable_grad() = at::Tensor();
  if (transform)
    transform->attach(param, unsharded, compute);
  else
    param.set_data(unsharded);
}

bool ShardedParam::compute_copy_current() const {
  return compute_copy_versions[0] == int64_t(param._version()) &&
         compute_copy_versions[1] == int64_t(padded_shard._version());
}

void ShardedParam::note_compute_copy_made() {
  compute_copy_versions[0] = int64_t(param._version());
  compute_copy_versions[1] = int64_t(padded_shard._version());
}

void ShardedParam::point_at_shard() {
  TORCH_INTERNAL_ASSERT(!param.grad().defined(), "fsdp: resharding '", name, "' would drop its unreduced gradient");
  if (transform) transform->detach(param);
  param.set_data(shard);
  param.mutable_grad() = std::exchange(stashed_grad, at::Tensor());
}

void ShardedParam::add_reduced_gradient(const at::Tensor& reduced, int rank, bool keep_dtype) {
  at::Tensor rows = reduced.view(padded_shard.sizes()).narrow(0, 0, layout.local_rows(rank));
  rows = rows.scalar_type() == shard.scalar_type() || keep_dtype ? alias_without_view(rows) : rows.to(shard.scalar_type());
  if (param.grad().defined())
    param.mutable_grad().add_(rows);
  else
    param.mutable_grad() = rows;
}

}  // namespace fsdp
