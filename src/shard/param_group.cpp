#include "shard/param_group.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Allocator.h>
#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>

#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>

#include "float8/gathered_weights.h"
#include "fsdp/float8.h"
#include "shard/flat_copy.h"
#include "shard/trace.h"

namespace fsdp {
namespace {

// The shape of a [rows, ...] block of a parameter with `full_shape`.
std::vector<int64_t> rows_shape(const std::vector<int64_t>& full_shape, int64_t rows) {
  std::vector<int64_t> shape = full_shape.empty() ? std::vector<int64_t>{1} : full_shape;
  shape[0] = rows;
  return shape;
}

// The same memory as `view` but not an autograd view of it: optimizers call
// detach_() on gradients (zero_grad), which views refuse. The gradient keeps
// the reduce-scatter output alive; no copy is made.
at::Tensor alias_without_view(const at::Tensor& view) {
  return at::empty({0}, view.options())
      .set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
}

// Runs `issue` on the side stream of `track` (on GPUs): the side stream first
// waits for the compute stream's position (the first stream rule in
// src/shard/README.md), and the work is one trace span. Returns the side stream's
// event after it; null on CPU, where everything completed in the call.
// `after`: an event of another side stream the work must also follow.
template <class Issue>
std::shared_ptr<c10::Event> issue_on_side_stream(const DeviceStreams& streams, Trace::Track track,
                                                 const std::string& span_name, Issue&& issue,
                                                 const c10::Event* after = nullptr) {
  std::optional<c10::Stream> side;
  if (streams.active())
    side = track == Trace::Track::AllGather       ? streams.all_gather()
           : track == Trace::Track::ReduceScatter ? streams.reduce_scatter()
                                                  : streams.all_reduce();
  std::optional<c10::StreamGuard> on_side_stream;
  if (side) {
    streams.wait(*side, streams.compute());
    if (after) streams.wait(*side, *after);
    on_side_stream.emplace(*side);
  }
  const int span = Trace::get().begin(span_name, track, side);
  issue();
  Trace::get().end(span, side);
  return side ? streams.record(*side) : nullptr;
}

std::string bucket_label(const std::vector<ParamGroup*>& groups) {
  std::string label;
  for (const ParamGroup* g : groups) label += (label.empty() ? "" : " + ") + g->label();
  return label;
}

}  // namespace

ParamGroup::ParamGroup(std::vector<std::pair<std::string, at::Tensor>> params, const ShardOptions& options)
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
    ShardedParam p;
    p.name = name;
    p.param = t;
    p.full_shape = t.sizes().vec();
    p.layout = ShardLayout::of_shape(t.sizes(), world);
    p.offset = shard_numel_;
    shard_numel_ += p.layout.shard_numel();
    p.float8 = float8_all_gather_enabled(t);
    if (p.float8 && cpu_offload)
      throw std::invalid_argument("fsdp::fully_shard: parameter '" + name + "' is gathered in float8 "
                                  "(enable_float8_all_gather), which a group with cpu_offload cannot do: "
                                  "drop one of the two for it");
    if (p.float8 && device_.is_cuda() && t.size(1) % 16 != 0)
      throw std::invalid_argument("fsdp::fully_shard: parameter '" + name + "' has " + std::to_string(t.size(1)) +
                                  " columns; float8 all-gather on GPUs needs a multiple of 16 (the float8 "
                                  "GEMMs' rule): do not call enable_float8_all_gather on it");
    params_.push_back(std::move(p));
  }
  // Each kind of all-gather (compute dtype, float8) lays out its parameters one after another.
  int64_t next[2] = {0, 0};
  for (auto& p : params_) {
    p.gather_offset = next[p.float8];
    next[p.float8] += p.layout.shard_numel();
  }
  float8_numel_ = next[1];
  // Offloaded: one flat host buffer, parameter after parameter as in the all-gather input, so the
  // copy to the device is one transfer; pinned, so that it runs asynchronously on the stream.
  if (cpu_offload)
    host_shards_ = at::zeros({shard_numel_}, at::TensorOptions()
                                                 .dtype(common_dtype.value_or(at::kFloat))
                                                 .pinned_memory(device_.type() != at::kCPU));
  for (auto& p : params_) {
    const at::Tensor& t = p.param;
    const auto padded_shape = rows_shape(p.full_shape, p.layout.shard_rows());
    p.padded_shard = offloaded() ? host_shards_.narrow(0, p.offset, p.layout.shard_numel()).view(padded_shape)
                                 : at::zeros(padded_shape, t.options());
    const int64_t local = p.layout.local_rows(rank);
    p.shard = p.padded_shard.narrow(0, 0, local);
    // A rank past the last row owns none (start clamped so narrow accepts it).
    const int64_t first = std::min(p.layout.first_row(rank), p.layout.rows);
    p.shard.copy_(t.reshape(rows_shape(p.full_shape, p.layout.rows)).narrow(0, first, local));
    if (t.grad().defined())
      throw std::invalid_argument("fsdp::fully_shard: parameter '" + p.name +
                                  "' already has a gradient: call zero_grad() (set_to_none) or "
                                  "shard before the first backward");
    p.param.set_data(p.shard);
  }
  unsharded_storage_ = c10::Storage(c10::Storage::use_byte_size_t(), 0,
                                    c10::GetAllocator(device_.type()), /*resizable=*/false);
}

ParamGroup::~ParamGroup() = default;

void ParamGroup::allocate_unsharded() {
  const int64_t world = comm_->world_size(), numel = gather_numel(false) * world;
  const size_t compute_bytes = numel * c10::elementSize(compute_dtype_);
  // The float8 parameters follow, 16-byte aligned (the float8 GEMMs' and casts' alignment).
  const size_t float8_start = (compute_bytes + 15) / 16 * 16;
  const size_t bytes = float8_numel_ > 0 ? float8_start + float8_numel_ * world : compute_bytes;
  unsharded_storage_.set_data_ptr_noswap(c10::GetAllocator(device_.type())->allocate(bytes));
  unsharded_storage_.set_nbytes(bytes);
  const auto options = at::TensorOptions().dtype(compute_dtype_).device(device_);
  unsharded_flat_ = at::empty({0}, options).set_(unsharded_storage_, 0, {numel}, {1});
  if (float8_numel_ > 0)
    unsharded_float8_ = at::empty({0}, options.dtype(at::kFloat8_e4m3fn))
                            .set_(unsharded_storage_, static_cast<int64_t>(float8_start), {float8_numel_ * world}, {1});
}

void ParamGroup::free_unsharded() {
  unsharded_flat_ = at::Tensor();
  unsharded_float8_ = at::Tensor();
  unsharded_storage_.set_data_ptr_noswap(c10::DataPtr(nullptr, device_));
  unsharded_storage_.set_nbytes(0);
}

// Parameter-major: parameter i's padded rows occupy world * shard_numel_i
// consecutive elements, so its real rows are a contiguous view.
at::Tensor ParamGroup::unsharded_view(const ShardedParam& p) const {
  const int world = comm_->world_size();
  return unsharded(p.float8).narrow(0, p.gather_offset * world, p.layout.shard_numel() * world)
      .view(rows_shape(p.full_shape, p.layout.padded_rows()))
      .narrow(0, 0, p.layout.rows)
      .view(p.full_shape);
}

// NaN, not zero: a reader other than float8_linear (a weight tied to another module, a hook) gets a
// NaN loss that stops training rather than a plausible wrong one.
at::Tensor ParamGroup::float8_placeholder(const ShardedParam& p) const {
  const auto options = at::TensorOptions().dtype(compute_dtype_).device(device_);
  return at::full({}, std::numeric_limits<double>::quiet_NaN(), options).expand(p.full_shape);
}

int64_t ParamGroup::gather_count(bool float8) const {
  return std::count_if(params_.begin(), params_.end(), [&](const ShardedParam& p) { return p.float8 == float8; });
}

void ParamGroup::unshard() { unshard_together({this}); }

void ParamGroup::unshard_together(const std::vector<ParamGroup*>& requested) {
  std::vector<ParamGroup*> groups;
  for (ParamGroup* g : requested)
    if (g->state_ == State::Sharded) groups.push_back(g);
  if (groups.empty()) return;
  const ParamGroup& first = *groups.front();
  for (ParamGroup* g : groups)
    TORCH_INTERNAL_ASSERT(g->comm_ == first.comm_ && g->device_ == first.device_,
                          "fsdp: groups gathered together must share communicator and device");
  const DeviceStreams& streams = first.streams_;
  c10::NoGradGuard no_grad;
  // Every buffer comes from the compute stream's pool (allocated before the
  // switch to the all-gather stream), so that unsharded parameters and
  // activations share one pool and no side-stream pool keeps memory reserved.
  std::vector<GatherBuffers> buffers;
  std::vector<at::Tensor> inputs, outputs;
  for (ParamGroup* g : groups) {
    buffers.push_back(g->allocate_gather());
    g->add_gather_ops(buffers.back(), inputs, outputs);
  }
  // The copy-in reads the shards the optimizer last wrote on the compute
  // stream (offloaded: on the host, before this call); issue_on_side_stream's
  // wait for it also orders the reuse of memory.
  const std::string label = bucket_label(groups);
  std::shared_ptr<c10::Event> gathered =
      issue_on_side_stream(streams, Trace::Track::AllGather, "all-gather " + label, [&] {
        for (size_t i = 0; i < groups.size(); ++i) groups[i]->copy_in(buffers[i]);
        first.comm_->all_gather_coalesced(outputs, inputs, label);
      });
  // Only metadata changes here: kernels that read the parameters are
  // enqueued after wait_for_unshard() has ordered them after the gather.
  for (size_t i = 0; i < groups.size(); ++i) {
    ParamGroup* g = groups[i];
    int64_t float8_index = 0;
    for (auto& p : g->params_) {
      p.stashed_grad = p.param.grad();
      p.param.mutable_grad() = at::Tensor();
      if (p.float8) {
        p.param.set_data(g->float8_placeholder(p));
        float8::set_gathered(p.param, {g->unsharded_view(p), buffers[i].float8_inverse_scale[float8_index++][0]});
      } else {
        p.param.set_data(g->unsharded_view(p));
      }
    }
    g->gathered_ = gathered;
    // Compute-pool blocks the all-gather stream still uses: kept until the
    // compute stream has waited for `gathered`.
    GatherBuffers& b = buffers[i];
    for (at::Tensor* t : {&b.input, &b.float8_input, &b.staging, &b.float8_inverse_scale})
      if (t->defined()) g->gather_buffers_.push_back(std::move(*t));
    g->state_ = State::Gathering;
  }
}

ParamGroup::GatherBuffers ParamGroup::allocate_gather() {
  const auto opts = at::TensorOptions().dtype(compute_dtype_).device(device_);
  const int world = comm_->world_size();
  allocate_unsharded();
  GatherBuffers b;
  for (bool float8 : {false, true}) {
    if (float8 && float8_numel_ == 0) continue;
    const at::Tensor& unsharded = this->unsharded(float8);
    // Each parameter is gathered straight into its unsharded rows (add_gather_ops). One rank: the
    // input's layout (each parameter's padded shard at its offset) is the unsharded storage's, so
    // the shards are cast straight into it and nothing is gathered.
    (float8 ? b.float8_input : b.input) =
        world == 1 ? unsharded : at::empty({gather_numel(float8)}, unsharded.options());
  }
  // One row of 16 bytes per weight: cuBLASLt takes a scale only at a 16-byte aligned address.
  if (float8_numel_ > 0) b.float8_inverse_scale = at::empty({gather_count(true), 4}, opts.dtype(at::kFloat));
  if (needs_staging())
    b.staging = at::empty({shard_numel_}, opts.dtype(host_shards_.scalar_type()));
  return b;
}

// The copy-in (and cast) of the whole group as one multi-tensor kernel
// (`cat` into another dtype would cast each shard in a kernel of its own).
// Offloaded shards are already laid out as the input: one transfer, then the
// cast on the device (a cross-device copy that casts would cast on the host).
// Float8 parameters: each shard cast with its amax over all ranks (refresh_float8_amax), one kernel
// each, into the float8 input.
void ParamGroup::copy_in(const GatherBuffers& buffers) {
  const at::Tensor& input = buffers.input;
  if (offloaded()) {  // no float8 parameters (the constructor refuses them)
    if (buffers.staging.defined()) {
      buffers.staging.copy_(host_shards_, /*non_blocking=*/true);
      input.copy_(buffers.staging);
    } else {
      input.copy_(host_shards_, /*non_blocking=*/true);
    }
    return;
  }
  std::vector<at::Tensor> shards;
  std::vector<int64_t> sizes;
  for (const auto& p : params_) {
    if (p.float8) continue;
    shards.push_back(p.padded_shard.view(-1));
    sizes.push_back(p.layout.shard_numel());
  }
  if (!shards.empty()) at::_foreach_copy_(input.split_with_sizes(sizes), shards);
  if (float8_numel_ == 0) return;
  if (!float8_amax_.defined()) refresh_float8_amax({this});
  int64_t index = 0;
  for (const auto& p : params_) {
    if (!p.float8) continue;
    const at::Tensor out = buffers.float8_input.narrow(0, p.gather_offset, p.layout.shard_numel());
    float8::cast_with_amax(p.padded_shard, float8_amax_[index], out.view(p.padded_shard.sizes()),
                           buffers.float8_inverse_scale[index][0]);
    ++index;
  }
}

// Parameter-major unsharded storage: a parameter's padded rows, rank after rank, are what an
// all-gather of its shard alone writes, so each parameter is one all-gather of the coalesced
// collective straight into its rows, and nothing is copied after (one flat all-gather would
// leave a rank-major buffer to reorder: 21 ms a step of copies on the 8B, 4 GPUs). One rank:
// the input is the storage, one collective that moves nothing.
void ParamGroup::add_gather_ops(const GatherBuffers& buffers, std::vector<at::Tensor>& inputs,
                                std::vector<at::Tensor>& outputs) const {
  const int world = comm_->world_size();
  for (bool float8 : {false, true}) {
    if (float8 && float8_numel_ == 0) continue;
    // Float8 parameters travel as bytes (the backends know no float8 dtype).
    const auto as_sent = [float8](const at::Tensor& t) { return float8 ? t.view(at::kByte) : t; };
    const at::Tensor input = as_sent(buffers.input_of(float8)), output = as_sent(unsharded(float8));
    if (world == 1) {
      inputs.push_back(input);
      outputs.push_back(output);
      continue;
    }
    for (const auto& p : params_) {
      const int64_t n = p.layout.shard_numel();
      if (p.float8 != float8 || n == 0) continue;
      inputs.push_back(input.narrow(0, p.gather_offset, n));
      outputs.push_back(output.narrow(0, p.gather_offset * world, n * world));
    }
  }
}

void ParamGroup::refresh_float8_amax(const std::vector<ParamGroup*>& groups) {
  c10::NoGradGuard no_grad;
  std::vector<ParamGroup*> pending;
  for (ParamGroup* g : groups)
    if (g->float8_numel_ > 0) pending.push_back(g);
  while (!pending.empty()) {
    // The groups on the first one's communicator: one all-gather for all of them.
    const std::shared_ptr<Communicator> comm = pending.front()->comm_;
    std::vector<ParamGroup*> same, rest;
    for (ParamGroup* g : pending) (g->comm_ == comm ? same : rest).push_back(g);
    std::vector<at::Tensor> shards;
    for (ParamGroup* g : same)
      for (const auto& p : g->params_)
        if (p.float8) shards.push_back(p.padded_shard);
    at::Tensor amax = at::stack(at::_foreach_norm(shards, INFINITY)).to(at::kFloat);
    if (comm->world_size() > 1) {
      at::Tensor all = at::empty({comm->world_size() * amax.numel()}, amax.options());
      comm->all_gather(all, amax);
      amax = at::amax(all.view({comm->world_size(), amax.numel()}), {0});
    }
    int64_t next = 0;
    for (ParamGroup* g : same) {
      const int64_t count = g->gather_count(true);
      g->float8_amax_ = amax.narrow(0, next, count);
      next += count;
    }
    pending = std::move(rest);
  }
}

size_t ParamGroup::unsharded_size_bytes() const {
  return static_cast<size_t>(comm_->world_size()) *
         (gather_numel(false) * c10::elementSize(compute_dtype_) + float8_numel_);
}

GroupMemory ParamGroup::memory() const {
  const int64_t world = comm_->world_size(), compute = c10::elementSize(compute_dtype_);
  const int64_t reduce = c10::elementSize(reduce_dtype_), count = static_cast<int64_t>(params_.size());
  int64_t trainable_numel = 0;
  for (const auto& p : params_)
    if (p.param.requires_grad()) trainable_numel += c10::multiply_integers(p.full_shape);
  GroupMemory memory;
  memory.param_bytes = unsharded_size_bytes();
  // Each all-gather's input (allocate_gather; it gathers into the unsharded storage); one rank
  // gathers in place.
  if (world > 1) memory.gather_buffer_bytes += gather_numel(false) * compute + float8_numel_;
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

void ParamGroup::wait_for_unshard() {
  unshard();
  if (state_ != State::Gathering) return;
  if (gathered_) streams_.wait(streams_.compute(), *gathered_);
  gathered_ = nullptr;
  gather_buffers_.clear();  // later compute work is ordered after the gather
  state_ = State::Unsharded;
}

std::shared_ptr<c10::Event> ParamGroup::reshard() {
  if (state_ == State::Sharded) return nullptr;
  for (auto& p : params_) {
    TORCH_INTERNAL_ASSERT(!p.param.grad().defined(),
                          "fsdp: resharding '", p.name, "' would drop its unreduced gradient");
    if (p.float8) float8::clear_gathered(p.param);
    p.param.set_data(p.shard);
    p.param.mutable_grad() = std::move(p.stashed_grad);
    p.stashed_grad = at::Tensor();
  }
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

void ParamGroup::prepare_reduce_scatter() {
  TORCH_INTERNAL_ASSERT(state_ == State::Unsharded, "fsdp: reduce-scatter needs unsharded parameters");
  TORCH_INTERNAL_ASSERT(reduced_.empty() && reduce_input_.empty(), "fsdp: the previous reduce-scatter was not committed");
  c10::NoGradGuard no_grad;
  const int world = comm_->world_size();
  const int64_t count = static_cast<int64_t>(params_.size());
  // Copy-in on the compute stream, where autograd made the gradients: they can then be freed at
  // once. The input lives until its reduce-scatter is done (reduce_scatter_together's work holds
  // it). Gradients held unsynced over earlier backward passes are sums in the reduce dtype: this
  // backward's are added to them.
  std::vector<at::Tensor> grads;
  bool summed = false;
  for (auto& p : params_) {
    at::Tensor grad = p.param.grad();
    if (p.unsynced_grad.defined()) {
      summed = true;
      if (grad.defined()) p.unsynced_grad.add_(grad);
      grad = std::move(p.unsynced_grad);
      p.unsynced_grad = at::Tensor();
    }
    grads.push_back(std::move(grad));
    p.param.mutable_grad() = at::Tensor();
  }
  all_local_grads_ = std::all_of(grads.begin(), grads.end(), [](const at::Tensor& g) { return g.defined(); });
  const auto opts = at::TensorOptions().dtype(reduce_dtype_).device(device_);
  if (reduces_each_in_place()) {
    // A gradient already in the reduce dtype that owns all its memory (not a slice of a larger
    // buffer, which it would keep alive) is the input as it is; one multi-tensor copy casts the
    // others each into a tensor of its own.
    const auto owns_its_memory = [](const at::Tensor& t) {
      return t.is_contiguous() && t.storage_offset() == 0 && t.storage().nbytes() == t.nbytes();
    };
    std::vector<at::Tensor> from, to;
    for (at::Tensor& grad : grads) {
      if (grad.defined() && (grad.scalar_type() != reduce_dtype_ || !owns_its_memory(grad))) {
        from.push_back(std::move(grad));
        grad = at::empty(from.back().sizes(), opts);
        to.push_back(grad);
      }
      reduce_input_.push_back(std::move(grad));
    }
    if (!to.empty()) at::_foreach_copy_(to, from);
    return;
  }
  // After the gradients come one flag per parameter for each rank: 1 where this rank has a
  // gradient. Reduced with the gradients, a flag above zero means some rank had one, so all ranks
  // agree on which gradients exist without another collective. One kernel writes (and casts)
  // every parameter's rows and the flags (a [world, count] tensor: one row for each rank); every
  // piece goes in one dtype (one kernel takes one).
  const auto grad_opts = at::TensorOptions().dtype(summed ? reduce_dtype_ : compute_dtype_).device(device_);
  std::vector<at::Tensor> pieces;
  std::vector<ShardLayout> layouts;
  std::vector<float> flags;
  for (size_t i = 0; i < params_.size(); ++i) {
    flags.push_back(grads[i].defined() ? 1.0f : 0.0f);
    pieces.push_back(grads[i].defined() ? grads[i].to(grad_opts.dtype()) : at::Tensor());
    layouts.push_back(params_[i].layout);
  }
  pieces.push_back(all_local_grads_ ? at::ones({world, count}, grad_opts)
                                    : at::tensor(flags).to(grad_opts).expand({world, count}));
  layouts.push_back(flags_layout());
  reduce_input_.push_back(at::empty({world * (shard_numel_ + count)}, opts));
  parameter_major_into(reduce_input_.back(), pieces, layouts);
}

ShardLayout ParamGroup::flags_layout() const {
  return ShardLayout{comm_->world_size(), static_cast<int64_t>(params_.size()), comm_->world_size()};
}

std::vector<at::Tensor> ParamGroup::add_reduce_ops(std::vector<at::Tensor>& inputs,
                                                   std::vector<at::Tensor>& outputs) const {
  std::vector<at::Tensor> results;
  if (reduces_each_in_place()) {  // one rank: each gradient is reduced in place, alone
    for (const at::Tensor& input : reduce_input_) {
      results.push_back(input.defined() ? input.view(-1) : at::Tensor());
      if (!input.defined()) continue;
      inputs.push_back(results.back());
      outputs.push_back(results.back());
    }
    return results;
  }
  const at::Tensor& input = reduce_input_.front();
  const int world = comm_->world_size();
  if (world == 1) {  // one collective, which reduces nothing (HSDP's replicas or an offload follow)
    inputs.push_back(input);
    outputs.push_back(input);
    return {input};
  }
  const at::Tensor output = at::empty({input.numel() / world}, input.options());
  // One piece per parameter slot (parameter_major_into), then the flags'.
  int64_t offset = 0;
  const auto add = [&](const ShardLayout& layout) {
    const int64_t n = layout.shard_numel();
    if (n > 0) {
      inputs.push_back(input.narrow(0, offset * world, n * world));
      outputs.push_back(output.narrow(0, offset, n));
    }
    offset += n;
  };
  for (const auto& p : params_) add(p.layout);
  add(flags_layout());
  return {output};
}

void ParamGroup::hold_unsynced_gradients() {
  TORCH_INTERNAL_ASSERT(state_ == State::Unsharded, "fsdp: unsynced gradients need unsharded parameters");
  c10::NoGradGuard no_grad;
  for (auto& p : params_) {
    at::Tensor grad = p.param.grad();
    if (!grad.defined()) continue;
    if (p.unsynced_grad.defined())
      p.unsynced_grad.add_(grad);
    else
      p.unsynced_grad = grad.to(reduce_dtype_, /*non_blocking=*/false, /*copy=*/true);
    p.param.mutable_grad() = at::Tensor();
  }
}

DeviceWork ParamGroup::reduce_scatter_together(const std::vector<ParamGroup*>& groups) {
  DeviceWork work;
  if (groups.empty()) return work;
  const ParamGroup& first = *groups.front();
  const DeviceStreams& streams = first.streams_;
  c10::NoGradGuard no_grad;
  // Outputs from the compute stream's pool, like every buffer (see unshard_together).
  std::vector<at::Tensor> inputs, outputs;  // the collective's pieces
  std::vector<std::vector<at::Tensor>> results;  // each group's: what becomes its reduced_
  for (ParamGroup* g : groups) {
    const size_t prepared = g->reduces_each_in_place() ? g->params_.size() : 1;
    TORCH_INTERNAL_ASSERT(g->reduce_input_.size() == prepared && g->comm_ == first.comm_ && g->replicate_ == first.replicate_,
                          "fsdp: reduce-scatter of a group without prepared gradients");
    results.push_back(g->add_reduce_ops(inputs, outputs));
  }
  const std::string label = bucket_label(groups);
  // Offloaded groups' results (one flat buffer each) go to the host behind the last collective,
  // into pinned memory (the host allocator reuses a block only after the copies recorded on it are
  // done).
  std::vector<at::Tensor> host_results(groups.size());
  const auto copy_offloaded_to_host = [&] {
    for (size_t i = 0; i < groups.size(); ++i)
      if (groups[i]->offloaded()) {
        const at::Tensor& out = results[i].front();
        host_results[i] = at::empty(out.sizes(), out.options().device(at::kCPU).pinned_memory(out.device().type() != at::kCPU));
        host_results[i].copy_(out, /*non_blocking=*/true);
      }
  };
  const Communicator* replicate = first.replicate_.get();
  work.event = issue_on_side_stream(streams, Trace::Track::ReduceScatter, "reduce-scatter " + label, [&] {
    first.comm_->reduce_scatter_coalesced(outputs, inputs, ReduceOp::Avg, label);
    if (!replicate) copy_offloaded_to_host();
  });
  // HSDP: the shards are averaged over the replicas on a stream of their own, so that the next
  // reduce-scatter need not wait for it. The work's event is then this stream's, after both.
  if (replicate)
    work.event = issue_on_side_stream(
        streams, Trace::Track::AllReduce, "all-reduce " + label,
        [&] {
          for (const auto& group_results : results)  // one flat buffer each (HSDP: never in place)
            first.replicate_->all_reduce(group_results.front(), ReduceOp::Avg);
          copy_offloaded_to_host();
        },
        work.event.get());
  for (size_t i = 0; i < groups.size(); ++i) {
    ParamGroup& g = *groups[i];
    for (at::Tensor& input : g.reduce_input_)
      if (input.defined()) work.keep_alive.push_back(std::move(input));
    g.reduce_input_.clear();
    if (g.offloaded()) {  // the device result, read by the copy, until the work is done
      work.keep_alive.push_back(std::move(results[i].front()));
      results[i].front() = std::move(host_results[i]);
    }
    g.reduced_ = std::move(results[i]);
    g.reduced_at_ = work.event;
  }
  return work;
}

void ParamGroup::commit_gradients(const std::vector<ParamGroup*>& all) {
  std::vector<ParamGroup*> groups;
  for (ParamGroup* g : all)
    if (!g->reduced_.empty()) groups.push_back(g);
  c10::NoGradGuard no_grad;
  // Which parameters some rank had a gradient for: the flags after the flat buffer's gradients.
  // Where each gradient was reduced in place alone, this rank's own gradients are all there are.
  const auto flags_of = [](const ParamGroup* g) {
    return g->reduced_.front().narrow(0, g->shard_numel_, static_cast<int64_t>(g->params_.size())).gt(0);
  };
  std::vector<at::Tensor> flags;  // of the groups on the device where this rank lacked some gradient
  for (ParamGroup* g : groups) {
    TORCH_INTERNAL_ASSERT(g->state_ == State::Sharded, "fsdp: commit gradients after resharding");
    if (g->reduced_at_ && g->offloaded())
      g->reduced_at_->synchronize();  // the host optimizer reads the copy
    else if (g->reduced_at_)
      g->streams_.wait(g->streams_.compute(), *g->reduced_at_);
    if (!g->all_local_grads_ && !g->offloaded() && !g->reduces_each_in_place()) flags.push_back(flags_of(g));
  }
  // Where this rank had every gradient, every parameter has one: the common
  // step reads no flags, never waits for the device here, and the optimizer
  // queues up behind backward. Otherwise one device-to-host copy for all
  // groups on the device that lacked some (offloaded ones have them on the host).
  const at::Tensor read = flags.empty() ? at::Tensor() : at::cat(flags).to(at::kCPU);
  const bool* next = read.defined() ? read.data_ptr<bool>() : nullptr;
  for (ParamGroup* g : groups) {
    std::vector<bool> had_grad(g->params_.size(), true);
    if (g->reduces_each_in_place()) {
      for (size_t i = 0; i < had_grad.size(); ++i) had_grad[i] = g->reduced_[i].defined();
    } else if (!g->all_local_grads_) {
      const at::Tensor own = g->offloaded() ? flags_of(g) : at::Tensor();
      const bool* from = own.defined() ? own.data_ptr<bool>() : next;
      for (size_t i = 0; i < had_grad.size(); ++i) had_grad[i] = from[i];
      if (!own.defined()) next += had_grad.size();
    }
    g->add_reduced_gradients(had_grad);
  }
}

void ParamGroup::add_reduced_gradients(const std::vector<bool>& had_grad) {
  const int rank = comm_->rank();
  const bool each = reduces_each_in_place();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!had_grad[i]) continue;
    const at::Tensor reduced = each ? reduced_[i].view(-1) : reduced_.front().narrow(0, p.offset, p.layout.shard_numel());
    at::Tensor rows = reduced.view(p.padded_shard.sizes()).narrow(0, 0, p.layout.local_rows(rank));
    rows = rows.scalar_type() == p.shard.scalar_type() || keep_low_precision_grads_ ? alias_without_view(rows)
                                                                                  : rows.to(p.shard.scalar_type());
    if (p.param.grad().defined())
      p.param.mutable_grad().add_(rows);
    else
      p.param.mutable_grad() = rows;
  }
  reduced_.clear();
  reduced_at_ = nullptr;
}

at::Tensor ParamGroup::gather_full(size_t i) const {
  const auto& p = params_.at(i);
  at::Tensor out = at::empty({p.layout.shard_numel() * comm_->world_size()},
                             at::TensorOptions().dtype(p.padded_shard.scalar_type()).device(device_));
  comm_->all_gather(out, p.padded_shard.view(-1).to(device_));
  return out.view(rows_shape(p.full_shape, p.layout.padded_rows()))
      .narrow(0, 0, p.layout.rows)
      .reshape(p.full_shape)
      .clone();
}

}  // namespace fsdp
