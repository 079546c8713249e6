// The all-gather path: a bucket of groups unsharded in one coalesced collective of a piece per
// parameter, straight into each group's unsharded storage (src/shard/README.md).
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <typeindex>
#include <typeinfo>

#include "shard/group_params.h"
#include "shard/side_stream.h"

namespace fsdp {

void GroupParams::unshard() { unshard_together({this}); }

void GroupParams::unshard_together(const std::vector<GroupParams*>& requested) {
  std::vector<GroupParams*> groups;
  for (GroupParams* g : requested)
    if (g->state_ == State::Sharded) groups.push_back(g);
  if (groups.empty()) return;
  const GroupParams& first = *groups.front();
  for (GroupParams* g : groups)
    TORCH_INTERNAL_ASSERT(g->comm_ == first.comm_ && g->device_ == first.device_,
                          "fsdp: groups gathered together must share communicator and device");
  const DeviceStreams& streams = first.streams_;
  c10::NoGradGuard no_grad;
  // Every buffer comes from the compute stream's pool (allocated before the
  // switch to the all-gather stream), so that unsharded parameters and
  // activations share one pool and no side-stream pool keeps memory reserved.
  std::vector<GatherBuffers> buffers;
  std::vector<at::Tensor> inputs, outputs;
  for (GroupParams* g : groups) {
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
    GroupParams* g = groups[i];
    const auto compute = at::TensorOptions().dtype(g->compute_dtype_).device(g->device_);
    for (auto& p : g->params_) p.point_at_unsharded(p.unsharded_view(g->unsharded(p.transformed())), compute);
    g->gathered_ = gathered;
    // Compute-pool blocks the all-gather stream still uses: kept until the
    // compute stream has waited for `gathered`.
    GatherBuffers& b = buffers[i];
    for (at::Tensor* t : {&b.input, &b.transformed_input, &b.staging})
      if (t->defined()) g->gather_buffers_.push_back(std::move(*t));
    g->state_ = State::Gathering;
  }
}

GroupParams::GatherBuffers GroupParams::allocate_gather() {
  const int world = comm_->world_size();
  allocate_unsharded();
  GatherBuffers b;
  for (bool transformed : {false, true}) {
    if (transformed && transformed_numel_ == 0) continue;
    const at::Tensor& unsharded = this->unsharded(transformed);
    // Each parameter is gathered straight into its unsharded rows (add_gather_ops). One rank: the
    // input's layout (each parameter's padded shard at its offset) is the unsharded storage's, so
    // the shards are cast straight into it and nothing is gathered.
    (transformed ? b.transformed_input : b.input) =
        world == 1                                  ? unsharded
        : !transformed && compute_shards_.defined() ? compute_shards_
                                                    : at::empty({gather_numel(transformed)}, unsharded.options());
  }
  const auto options = at::TensorOptions().device(device_);
  for (auto& p : params_)
    if (p.transform) p.transform->allocate(options);
  if (needs_staging())
    b.staging = at::empty({shard_numel_}, options.dtype(host_shards_.scalar_type()));
  return b;
}

// The copy-in (and cast) of the whole group as one multi-tensor kernel
// (`cat` into another dtype would cast each shard in a kernel of its own).
// Offloaded shards are already laid out as the input: one transfer, then the
// cast on the device (a cross-device copy that casts would cast on the host).
// Transformed parameters: each shard cast by its transform into the transformed input.
void GroupParams::copy_in(const GatherBuffers& buffers) {
  const at::Tensor& input = buffers.input;
  if (offloaded()) {  // no transformed parameters (make_gather_transform refuses them)
    if (buffers.staging.defined()) {
      buffers.staging.copy_(host_shards_, /*non_blocking=*/true);
      input.copy_(buffers.staging);
    } else {
      input.copy_(host_shards_, /*non_blocking=*/true);
    }
    return;
  }
  // Kept compute shards: only those whose master changed since their copy was made are cast.
  std::vector<at::Tensor> shards, pieces;
  for (auto& p : params_) {
    if (p.transform || p.layout.shard_numel() == 0) continue;
    if (compute_shards_.defined()) {
      if (p.compute_copy_current()) continue;
      p.note_compute_copy_made();
    }
    shards.push_back(p.padded_shard.view(-1));
    pieces.push_back(input.narrow(0, p.gather_offset, p.layout.shard_numel()));
  }
  if (!shards.empty()) at::_foreach_copy_(pieces, shards);
  if (transformed_numel_ == 0) return;
  const bool refreshed = std::all_of(params_.begin(), params_.end(),
                                     [](const ShardedParam& p) { return !p.transform || p.transform->refreshed(); });
  if (!refreshed) refresh_gather_transforms({this});
  for (const auto& p : params_) {
    if (!p.transform) continue;
    const at::Tensor piece = buffers.transformed_input.narrow(0, p.gather_offset, p.layout.shard_numel());
    p.transform->cast_in(p.padded_shard, piece.view(p.padded_shard.sizes()));
  }
}

// Parameter-major unsharded storage: a parameter's padded rows, rank after rank, are what an
// all-gather of its shard alone writes, so each parameter is one all-gather of the coalesced
// collective straight into its rows, and nothing is copied after (one flat all-gather would
// leave a rank-major buffer to reorder: 21 ms a step of copies on the 8B, 4 GPUs). One rank:
// the input is the storage, one collective that moves nothing.
void GroupParams::add_gather_ops(const GatherBuffers& buffers, std::vector<at::Tensor>& inputs,
                                std::vector<at::Tensor>& outputs) const {
  const int world = comm_->world_size();
  for (bool transformed : {false, true}) {
    if (transformed && transformed_numel_ == 0) continue;
    // Transformed parameters travel as bytes (the backends know no float8 dtype).
    const auto as_sent = [transformed](const at::Tensor& t) { return transformed ? t.view(at::kByte) : t; };
    const at::Tensor input = as_sent(buffers.input_of(transformed)), output = as_sent(unsharded(transformed));
    if (world == 1) {
      inputs.push_back(input);
      outputs.push_back(output);
      continue;
    }
    const int64_t sent_per_element = transformed ? c10::elementSize(transformed_dtype_) : 1;  // bytes, or 1
    for (const auto& p : params_) {
      const int64_t n = p.layout.shard_numel() * sent_per_element;
      if (p.transformed() != transformed || n == 0) continue;
      inputs.push_back(input.narrow(0, p.gather_offset * sent_per_element, n));
      outputs.push_back(output.narrow(0, p.gather_offset * sent_per_element * world, n * world));
    }
  }
}

void GroupParams::refresh_gather_transforms(const std::vector<GroupParams*>& groups) {
  c10::NoGradGuard no_grad;
  std::vector<GroupParams*> pending;
  for (GroupParams* g : groups)
    if (g->transformed_numel_ > 0) pending.push_back(g);
  while (!pending.empty()) {
    // The groups on the first one's communicator: one refresh of each kind of transform for all of
    // them, the kinds in the order they first appear (the same on every rank).
    const std::shared_ptr<Communicator> comm = pending.front()->comm_;
    std::vector<GroupParams*> same, rest;
    for (GroupParams* g : pending) (g->comm_ == comm ? same : rest).push_back(g);
    struct Kind {
      std::type_index type;
      std::vector<GatherTransform*> transforms;
      std::vector<at::Tensor> shards;
    };
    std::vector<Kind> kinds;
    for (GroupParams* g : same)
      for (const auto& p : g->params_) {
        if (!p.transform) continue;
        const std::type_index type = typeid(*p.transform);
        auto kind = std::find_if(kinds.begin(), kinds.end(), [&](const Kind& k) { return k.type == type; });
        if (kind == kinds.end()) kind = kinds.insert(kinds.end(), Kind{type, {}, {}});
        kind->transforms.push_back(p.transform.get());
        kind->shards.push_back(p.padded_shard);
      }
    for (const Kind& kind : kinds) kind.transforms.front()->refresh(kind.transforms, kind.shards, *comm);
    pending = std::move(rest);
  }
}

}  // namespace fsdp
