#include "shard/group_params.h"

#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Allocator.h>
#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <utility>

namespace fsdp {

GroupParams::GroupParams(std::vector<std::pair<std::string, at::Tensor>> params, const ShardOptions& options)
    : comm_(options.comm),
      replicate_(options.replicate),
      device_(params.empty() ? comm_->device() : params.front().second.device()),
      streams_(DeviceStreams::of(device_)) {
  const int world = comm_->world_size(), rank = comm_->rank();
  const MixedPrecision& mixed_precision = options.mixed_precision;
  const bool cpu_offload = options.cpu_offload;
  std::optional<at::ScalarType> common_dtype;
  for (auto& [name, t] : params) {
    if (t.device() != device_)
      throw std::invalid_argument("fsdp::fully_shard: parameter '" + name + "' is on " +
                                  t.device().str() + " but '" + params.front().first + "' is on " +
                                  device_.str() + ": move the module to one device first");
    // Offloaded shards share one host buffer, so they need one dtype even where the gather casts.
    if (common_dtype && *common_dtype != t.scalar_type() && (!mixed_precision.param_dtype || cpu_offload))
      throw std::invalid_argument(
          "fsdp::fully_shard: parameters of one group must share a dtype to be " +
          std::string(cpu_offload ? "offloaded" : "gathered") + " together ('" + name + "' is " +
          c10::toString(t.scalar_type()) + ", others " + c10::toString(*common_dtype) + "): " +
          (cpu_offload ? "" : "set MixedPrecision::param_dtype or ") + "shard them in separate fully_shard calls");
    common_dtype = t.scalar_type();
  }
  compute_dtype_ = mixed_precision.param_dtype.value_or(common_dtype.value_or(at::kFloat));
  reduce_dtype_ = mixed_precision.reduce_dtype.value_or(compute_dtype_);
  keep_low_precision_grads_ = mixed_precision.keep_low_precision_grads;

  c10::NoGradGuard no_grad;
  for (auto& [name, t] : params) {
    ShardedParam p(name, t, world, shard_numel_);
    shard_numel_ += p.layout.shard_numel();
    p.transform = make_gather_transform(name, t, cpu_offload, device_);
    if (p.transform) {
      const at::ScalarType dtype = p.transform->gathered_dtype();
      TORCH_INTERNAL_ASSERT(transformed_numel_ == 0 || dtype == transformed_dtype_,
                            "fsdp: one gathered dtype for a group's transformed parameters (a second "
                            "format needs a part of the unsharded storage of its own)");
      transformed_dtype_ = dtype;
      transformed_numel_ += p.layout.shard_numel();
    }
    params_.push_back(std::move(p));
  }
  // Each kind of all-gather (compute dtype, transformed) lays out its parameters one after another.
  int64_t next[2] = {0, 0};
  for (auto& p : params_) {
    p.gather_offset = next[p.transformed()];
    next[p.transformed()] += p.layout.shard_numel();
  }
  // Offloaded: one flat host buffer, parameter after parameter as in the all-gather input, so the
  // copy to the device is one transfer; pinned, so that it runs asynchronously on the stream.
  if (cpu_offload)
    host_shards_ = at::zeros({shard_numel_}, at::TensorOptions()
                                                 .dtype(common_dtype.value_or(at::kFloat))
                                                 .pinned_memory(device_.type() != at::kCPU));
  for (auto& p : params_) {
    const auto padded_shape = p.rows_shape(p.layout.shard_rows());
    p.shard_into(offloaded() ? host_shards_.narrow(0, p.offset, p.layout.shard_numel()).view(padded_shape)
                             : at::zeros(padded_shape, p.param.options()),
                 rank);
  }
  unsharded_storage_ = c10::Storage(c10::Storage::use_byte_size_t(), 0,
                                    c10::GetAllocator(device_.type()), /*resizable=*/false);
  if (options.keep_compute_shards) {
    if (cpu_offload)
      throw std::invalid_argument("fsdp::fully_shard: keep_compute_shards keeps device copies of the shards, and "
                                  "cpu_offload keeps the shards on the host: choose one");
    if (world == 1) {  // the unsharded storage is the all-gather's input: kept, it is the copy
      allocate_unsharded();
      compute_shards_ = unsharded_flat_;
    } else {
      compute_shards_ = at::empty({gather_numel(false)}, at::TensorOptions().dtype(compute_dtype_).device(device_));
    }
  }
}

GroupParams::~GroupParams() = default;

void GroupParams::allocate_unsharded() {
  if (keeps_unsharded_storage()) return;
  const int64_t world = comm_->world_size(), numel = gather_numel(false) * world;
  const size_t compute_bytes = numel * c10::elementSize(compute_dtype_);
  // The transformed parameters follow, 16-byte aligned (float8 GEMMs' and casts' alignment).
  const size_t transformed_start = (compute_bytes + 15) / 16 * 16;
  const size_t bytes = transformed_numel_ > 0
                           ? transformed_start + transformed_numel_ * world * c10::elementSize(transformed_dtype_)
                           : compute_bytes;
  unsharded_storage_.set_data_ptr_noswap(c10::GetAllocator(device_.type())->allocate(bytes));
  unsharded_storage_.set_nbytes(bytes);
  const auto options = at::TensorOptions().dtype(compute_dtype_).device(device_);
  unsharded_flat_ = at::empty({0}, options).set_(unsharded_storage_, 0, {numel}, {1});
  if (transformed_numel_ > 0) {
    const auto offset = static_cast<int64_t>(transformed_start / c10::elementSize(transformed_dtype_));
    unsharded_transformed_ = at::empty({0}, options.dtype(transformed_dtype_))
                                 .set_(unsharded_storage_, offset, {transformed_numel_ * world}, {1});
  }
}

void GroupParams::free_unsharded() {
  if (keeps_unsharded_storage()) return;
  unsharded_flat_ = at::Tensor();
  unsharded_transformed_ = at::Tensor();
  unsharded_storage_.set_data_ptr_noswap(c10::DataPtr(nullptr, device_));
  unsharded_storage_.set_nbytes(0);
}

at::Tensor GroupParams::compute_shard(size_t i) const {
  const ShardedParam& p = params_.at(i);
  if (!compute_shards_.defined() || p.transformed()) return {};
  return compute_shards_.narrow(0, p.gather_offset, p.shard.numel()).view(p.shard.sizes());
}

void GroupParams::note_compute_shard_written(size_t i) { params_.at(i).note_compute_copy_made(); }

void GroupParams::wait_for_unshard() {
  unshard();
  if (state_ != State::Gathering) return;
  if (gathered_) streams_.wait(streams_.compute(), *gathered_);
  gathered_ = nullptr;
  gather_buffers_.clear();  // later compute work is ordered after the gather
  state_ = State::Unsharded;
}

std::vector<at::Tensor> GroupParams::take_gradients() {
  TORCH_INTERNAL_ASSERT(state_ == State::Unsharded, "fsdp: gradients are taken off unsharded parameters");
  std::vector<at::Tensor> grads;
  for (auto& p : params_) grads.push_back(std::exchange(p.param.mutable_grad(), at::Tensor()));
  return grads;
}

std::shared_ptr<c10::Event> GroupParams::reshard() {
  if (state_ == State::Sharded) return nullptr;
  RECORD_USER_SCOPE("fsdp::reshard " + label_);  // a torch.profiler range, as the collectives'
  for (auto& p : params_) p.point_at_shard();
  // The buffers belong to the compute stream's pool: once the compute stream
  // is ordered after the gather (a prefetch that was never used waits here),
  // compute-stream work that reuses them runs after every read. The event
  // tells the CPU run-ahead limit when the GPU is really done with them.
  const bool used_by_compute = state_ == State::Unsharded;
  if (gathered_) streams_.wait(streams_.compute(), *gathered_);
  free_unsharded();
  gather_buffers_.clear();
  gathered_ = nullptr;
  state_ = State::Sharded;
  return used_by_compute ? streams_.record(streams_.compute()) : nullptr;
}

size_t GroupParams::unsharded_size_bytes() const {
  return static_cast<size_t>(comm_->world_size()) *
         (gather_numel(false) * c10::elementSize(compute_dtype_) + transformed_numel_ * c10::elementSize(transformed_dtype_));
}

GroupMemory GroupParams::memory() const {
  const int64_t world = comm_->world_size(), compute = c10::elementSize(compute_dtype_);
  const int64_t reduce = c10::elementSize(reduce_dtype_), count = static_cast<int64_t>(params_.size());
  int64_t trainable_numel = 0;
  for (const auto& p : params_)
    if (p.param.requires_grad()) trainable_numel += c10::multiply_integers(p.full_shape);
  GroupMemory memory;
  memory.param_bytes = unsharded_size_bytes();
  // Each all-gather's input (allocate_gather; it gathers into the unsharded storage); one rank
  // gathers in place.
  if (world > 1) memory.gather_buffer_bytes += unsharded_size_bytes() / world;
  if (needs_staging())
    memory.gather_buffer_bytes += shard_numel_ * host_shards_.element_size();  // the staging copy
  memory.grad_bytes = trainable_numel * compute;
  memory.unsynced_grad_bytes = trainable_numel * reduce;
  // This rank's part of the reduce-scatter: the gradients with one has-gradient flag per
  // parameter, except where each gradient is reduced alone.
  const int64_t output = (shard_numel_ + (reduces_each_in_place() ? 0 : count)) * reduce;
  // The sharded gradients (add_reduced_gradients): one that keeps the reduce dtype aliases the
  // output, which then stays allocated whole (reduced alone: its own tensor); one cast to its
  // parameter's dtype is a copy, and the output is freed unless another aliases it.
  int64_t aliased = 0, copied = 0;
  for (const auto& p : params_) {
    if (!p.param.requires_grad()) continue;
    if (keep_low_precision_grads_ || p.shard.scalar_type() == reduce_dtype_)
      aliased += p.layout.shard_numel() * reduce;
    else
      copied += p.layout.shard_numel() * static_cast<int64_t>(p.shard.element_size());
  }
  const int64_t kept_output = reduces_each_in_place() ? aliased : aliased > 0 ? output : 0;
  // Offloaded: the sharded result leaves the device with its reduce-scatter input. One rank
  // reduces in place (reduce_scatter_together): the input, counted from the hand-off to the end of
  // the reduce-scatter, then is the result, counted from there on (no device copy to offload from).
  memory.sharded_grad_bytes = offloaded() ? 0 : kept_output + copied;
  memory.reduce_input_bytes = world * output + (offloaded() && world > 1 ? output : 0);
  return memory;
}

at::Tensor GroupParams::gather_full(size_t i) const {
  const auto& p = params_.at(i);
  at::Tensor out = at::empty({p.layout.shard_numel() * comm_->world_size()},
                             at::TensorOptions().dtype(p.padded_shard.scalar_type()).device(device_));
  comm_->all_gather(out, p.padded_shard.view(-1).to(device_));
  return p.full_view(out).clone();
}

}  // namespace fsdp
