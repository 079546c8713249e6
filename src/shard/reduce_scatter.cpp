// The reduce-scatter path: a group's gradients prepared parameter-major (or held unsynced), a
// bucket of groups reduce-scattered in one coalesced collective, and the results committed as the
// sharded gradients (src/shard/README.md).
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <utility>

#include "shard/flat_copy.h"
#include "shard/group_params.h"
#include "shard/side_stream.h"

namespace fsdp {

void GroupParams::prepare_reduce_scatter(std::vector<at::Tensor> grads) {
  TORCH_INTERNAL_ASSERT(grads.size() == params_.size(), "fsdp: one gradient per parameter is handed off");
  TORCH_INTERNAL_ASSERT(reduced_.empty() && !gradients_prepared_, "fsdp: the previous reduce-scatter was not committed");
  gradients_prepared_ = true;
  c10::NoGradGuard no_grad;
  const int world = comm_->world_size();
  const int64_t count = static_cast<int64_t>(params_.size());
  // Copy-in on the compute stream, where autograd made the gradients: they can then be freed at
  // once. The input lives until its reduce-scatter is done (reduce_scatter_together's work holds
  // it). Gradients held unsynced over earlier backward passes are sums in the reduce dtype: this
  // backward's are added to them.
  bool summed = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    ShardedParam& p = params_[i];
    at::Tensor& grad = grads[i];
    if (p.unsynced_grad.defined()) {
      summed = true;
      if (grad.defined()) p.unsynced_grad.add_(grad);
      grad = std::move(p.unsynced_grad);
      p.unsynced_grad = at::Tensor();
    }
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
  // Across ranks each slot is a buffer of its own: made just after the group's gathered parameters
  // are freed (it reshards before the hand-off), the slots can take that memory piece by piece,
  // where one buffer of every gradient in the reduce dtype (twice the bf16 parameters' bytes in
  // float32) never fits it and goes on top of the pool. One rank keeps one buffer: it is the result.
  std::vector<at::Tensor> slots;
  if (world > 1) {
    for (const ShardLayout& layout : layouts) {
      reduce_input_.push_back(at::empty({layout.padded_rows() * layout.row_numel}, opts));
      slots.push_back(reduce_input_.back());
    }
  } else {
    reduce_input_.push_back(at::empty({shard_numel_ + count}, opts));
    slots = slots_of(reduce_input_.back(), layouts);
  }
  parameter_major_into(slots, pieces);
}

ShardLayout GroupParams::flags_layout() const {
  return ShardLayout{comm_->world_size(), static_cast<int64_t>(params_.size()), comm_->world_size()};
}

std::vector<at::Tensor> GroupParams::add_reduce_ops(std::vector<at::Tensor>& inputs,
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
  const int world = comm_->world_size();
  if (world == 1) {  // one collective, which reduces nothing (HSDP's replicas or an offload follow)
    const at::Tensor& input = reduce_input_.front();
    inputs.push_back(input);
    outputs.push_back(input);
    return {input};
  }
  const at::Tensor output = at::empty({shard_numel_ + static_cast<int64_t>(params_.size())},
                                      reduce_input_.front().options());
  // A piece per slot (prepare_reduce_scatter): each parameter's, then the flags'.
  int64_t offset = 0;
  for (size_t i = 0; i < reduce_input_.size(); ++i) {
    const int64_t n = reduce_input_[i].numel() / world;
    if (n > 0) {
      inputs.push_back(reduce_input_[i]);
      outputs.push_back(output.narrow(0, offset, n));
    }
    offset += n;
  }
  return {output};
}

void GroupParams::hold_unsynced_gradients(std::vector<at::Tensor> grads) {
  TORCH_INTERNAL_ASSERT(grads.size() == params_.size(), "fsdp: one gradient per parameter is handed off");
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    ShardedParam& p = params_[i];
    at::Tensor grad = std::move(grads[i]);
    if (!grad.defined()) continue;
    if (p.unsynced_grad.defined())
      p.unsynced_grad.add_(grad);
    else
      p.unsynced_grad = grad.to(reduce_dtype_, /*non_blocking=*/false, /*copy=*/true);
  }
}

DeviceWork GroupParams::reduce_scatter_together(const std::vector<GroupParams*>& groups) {
  DeviceWork work;
  if (groups.empty()) return work;
  const GroupParams& first = *groups.front();
  const DeviceStreams& streams = first.streams_;
  c10::NoGradGuard no_grad;
  // Outputs from the compute stream's pool, like every buffer (see unshard_together).
  std::vector<at::Tensor> inputs, outputs;  // the collective's pieces
  std::vector<std::vector<at::Tensor>> results;  // each group's: what becomes its reduced_
  for (GroupParams* g : groups) {
    TORCH_INTERNAL_ASSERT(g->gradients_prepared_ && g->comm_ == first.comm_ && g->replicate_ == first.replicate_,
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
    GroupParams& g = *groups[i];
    for (at::Tensor& input : g.reduce_input_)
      if (input.defined()) work.keep_alive.push_back(std::move(input));
    g.reduce_input_.clear();
    g.gradients_prepared_ = false;
    if (g.offloaded()) {  // the device result, read by the copy, until the work is done
      work.keep_alive.push_back(std::move(results[i].front()));
      results[i].front() = std::move(host_results[i]);
    }
    g.reduced_ = std::move(results[i]);
    g.reduced_at_ = work.event;
  }
  return work;
}

void GroupParams::commit_gradients(const std::vector<GroupParams*>& all) {
  std::vector<GroupParams*> groups;
  for (GroupParams* g : all)
    if (!g->reduced_.empty()) groups.push_back(g);
  c10::NoGradGuard no_grad;
  // Which parameters some rank had a gradient for: the flags after the flat buffer's gradients.
  // Where each gradient was reduced in place alone, this rank's own gradients are all there are.
  const auto flags_of = [](const GroupParams* g) {
    return g->reduced_.front().narrow(0, g->shard_numel_, static_cast<int64_t>(g->params_.size())).gt(0);
  };
  std::vector<at::Tensor> flags;  // of the groups on the device where this rank lacked some gradient
  for (GroupParams* g : groups) {
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
  for (GroupParams* g : groups) {
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

void GroupParams::add_reduced_gradients(const std::vector<bool>& had_grad) {
  const int rank = comm_->rank();
  const bool each = reduces_each_in_place();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!had_grad[i]) continue;
    p.add_reduced_gradient(each ? reduced_[i].view(-1) : reduced_.front().narrow(0, p.offset, p.layout.shard_numel()),
                           rank, keep_low_precision_grads_);
  }
  reduced_.clear();
  reduced_at_ = nullptr;
}

}  // namespace fsdp
