// One fully_shard call's parameters: sharded storage, the all-gather that
// unshards them and the reduce-scatter that shards their gradients (each one
// coalesced collective of a piece per parameter). Its parts, a file each:
// group_params.cpp the storage and the state machine (shard, unshard, reshard),
// all_gather.cpp and reduce_scatter.cpp the two collectives' paths over groups,
// sharded_param.h one parameter's part, gather_transform.h the formats a parameter can be
// gathered in (float8).
//
// Each managed parameter is the module's own tensor object. Its data flips
// (Variable::set_data) between the local shard and a view into the group's
// unsharded storage, so modules, autograd and optimizers always see one
// object. Forward saves views of that storage; it is freed on reshard by
// dropping its memory (same StorageImpl, zero bytes) and re-filled on the
// next unshard, so the saved views see the new data.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/communicator.h"
#include "fsdp/group_memory.h"
#include "fsdp/options.h"
#include "shard/gather_transform.h"
#include "shard/sharded_param.h"
#include "shard/streams.h"

namespace fsdp {

class GroupParams {
 public:
  // Shards `params` (full tensors) in place over options.comm (set). Not
  // collective: every rank already holds the full values (same seed or loaded
  // checkpoint). With cpu_offload the shards are views of one flat host
  // buffer (pinned on GPUs).
  GroupParams(std::vector<std::pair<std::string, at::Tensor>> params, const ShardOptions& options);
  ~GroupParams();

  // Collective. Issues the all-gather (on GPUs on the all-gather stream, and
  // returns at once) and points the parameters at their unsharded views;
  // their sharded gradients are set aside meanwhile.
  void unshard();
  // The same for several groups in one coalesced collective (bucketing).
  static void unshard_together(const std::vector<GroupParams*>& groups);
  // Unshards if needed and makes the compute stream wait for the
  // all-gather: call before the parameters are used.
  void wait_for_unshard();
  // Parameters go back to their shards and the unsharded memory is freed.
  // Returns the event marking the memory's last use on the compute stream
  // (null on CPU, or when nothing on the compute stream used it).
  std::shared_ptr<c10::Event> reshard();
  // Takes the full gradients off the unsharded parameters (one per parameter, undefined where it
  // has none) for the hand-off below, so that the group can reshard first: its parameters'
  // memory is then free before the reduce-scatter input is allocated (FSDP2's order; the root's
  // embedding and head otherwise stay gathered beside its input).
  std::vector<at::Tensor> take_gradients();
  // Copies taken gradients parameter-major into a reduce-scatter input on the compute stream and
  // frees them.
  void prepare_reduce_scatter(std::vector<at::Tensor> grads);
  // Gradient accumulation without communication: adds taken gradients into full-shape
  // sums in the reduce dtype (fp32 sums stay exact where bf16 ones would round at every
  // micro-batch) and frees them; the next prepare_reduce_scatter sends the sums. Memory: the
  // whole group's parameters in the reduce dtype, until then.
  void hold_unsynced_gradients(std::vector<at::Tensor> grads);
  // Collective. Averages the prepared inputs of `groups` over the world in
  // one coalesced reduce-scatter on the reduce-scatter stream (HSDP: then
  // over the replicas, on the all-reduce stream). The returned work keeps the
  // inputs alive until it is done; each group's result becomes its sharded
  // gradients at commit_gradients().
  static DeviceWork reduce_scatter_together(const std::vector<GroupParams*>& groups);
  // The compute stream waits for each group's reduce-scatter (the host, for
  // an offloaded group's copy of it); its result is added to the sharded
  // gradients (set where none exist). A parameter that
  // no rank produced a gradient for keeps its gradient undefined. Only where
  // this rank lacked some gradient are the reduced flags read (one wait for
  // the device for all such groups).
  static void commit_gradients(const std::vector<GroupParams*>& groups);

  bool is_unsharded() const { return state_ != State::Sharded; }
  // Bytes of the unsharded parameter storage now allocated (0 when sharded).
  size_t unsharded_bytes() const { return unsharded_storage_.nbytes(); }
  // Bytes the group takes when unsharded (what bucketing compares).
  size_t unsharded_size_bytes() const;
  // The bytes of each buffer above, with the lifetimes the runtime gives them (the planner's
  // cost model).
  GroupMemory memory() const;
  const std::vector<ShardedParam>& sharded() const { return params_; }
  Communicator& comm() const { return *comm_; }
  Communicator* replicate() const { return replicate_.get(); }  // HSDP's replicas; null: none
  const at::Device& device() const { return device_; }  // where it computes
  bool offloaded() const { return host_shards_.defined(); }
  // How traces name this group.
  void set_label(std::string label) { label_ = std::move(label); }
  const std::string& label() const { return label_; }
  // Collective. A full copy of parameter i (in its own dtype), on device().
  at::Tensor gather_full(size_t i) const;
  // ShardOptions::keep_compute_shards: parameter i's compute-dtype copy of its shard (the shard's
  // shape), undefined without one (or for a transformed parameter); and the note that an
  // optimizer wrote it from the current master.
  at::Tensor compute_shard(size_t i) const;
  void note_compute_shard_written(size_t i);
  // Collective over each communicator of `groups` (every rank passes its groups in the same order).
  // What the gather transforms' casts need from all ranks (float8: each weight's amax), from the
  // master shards as the optimizer left them: one collective per kind of transform for all of
  // them (GatherTransform::refresh). The runtime calls it at the start of each root's forward; a
  // group never refreshed refreshes its own at its first unshard.
  static void refresh_gather_transforms(const std::vector<GroupParams*>& groups);

 private:
  enum class State { Sharded, Gathering, Unsharded };
  // This group's part of an all-gather (which writes the unsharded storage): the input of the
  // parameters gathered in the compute dtype and of those gathered transformed, and for offloaded
  // shards of another dtype than the compute one, the device copy they are cast from.
  struct GatherBuffers {
    at::Tensor input, transformed_input, staging;
    const at::Tensor& input_of(bool transformed) const { return transformed ? transformed_input : input; }
  };
  GatherBuffers allocate_gather();
  // Offloaded shards of another dtype than the compute one, on a device: cast there, after the copy.
  bool needs_staging() const {
    return offloaded() && host_shards_.scalar_type() != compute_dtype_ && device_.type() != at::kCPU;
  }
  // The shards, cast, into the all-gather input (offloaded: copied from the
  // host on the all-gather stream first).
  void copy_in(const GatherBuffers& buffers);
  void add_reduced_gradients(const std::vector<bool>& had_grad);
  // One rank with no replicas and no host copy: the reduce-scatter leaves each gradient as it is,
  // so each parameter's goes in a tensor of its own instead of one flat buffer of the group. The
  // allocator can then put each where the block's activations were: a 3B block's flat buffer
  // (384 MiB in float32) is larger than that space (352 MiB) and landed above it, leaving it
  // unused at the step's peak.
  bool reduces_each_in_place() const { return comm_->world_size() == 1 && !replicate_ && !offloaded(); }
  // This group's pieces of a coalesced all-gather, appended: one per parameter, from its shard in
  // the input straight into its rows of the unsharded storage.
  void add_gather_ops(const GatherBuffers& buffers, std::vector<at::Tensor>& inputs,
                      std::vector<at::Tensor>& outputs) const;
  // This group's pieces of a coalesced reduce-scatter, appended: one per parameter (and one for the
  // flags) from the prepared input into one flat output; returns what becomes reduced_.
  std::vector<at::Tensor> add_reduce_ops(std::vector<at::Tensor>& inputs, std::vector<at::Tensor>& outputs) const;
  // The flags' slot after the gradients in a reduce-scatter input: one row of a flag per parameter
  // for each rank.
  ShardLayout flags_layout() const;
  // Per rank, the elements gathered transformed (or in the compute dtype).
  int64_t gather_numel(bool transformed) const {
    return transformed ? transformed_numel_ : shard_numel_ - transformed_numel_;
  }
  // The unsharded storage of the transformed parameters, or of the others.
  const at::Tensor& unsharded(bool transformed) const { return transformed ? unsharded_transformed_ : unsharded_flat_; }
  void allocate_unsharded();
  void free_unsharded();
  // keep_compute_shards on one rank: the unsharded storage is the kept copy, allocated for good.
  bool keeps_unsharded_storage() const { return compute_shards_.defined() && comm_->world_size() == 1; }

  std::vector<ShardedParam> params_;
  std::string label_ = "group";
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Communicator> replicate_;
  at::ScalarType compute_dtype_;
  at::ScalarType reduce_dtype_;
  bool keep_low_precision_grads_;  // the sharded gradients stay in reduce_dtype_ (MixedPrecision)
  at::Device device_;
  const DeviceStreams& streams_;
  int64_t shard_numel_ = 0;   // per rank, all parameters
  int64_t transformed_numel_ = 0;  // per rank, the parameters gathered transformed
  at::ScalarType transformed_dtype_ = at::kByte;  // their gathered_dtype() (one for the group)
  c10::Storage unsharded_storage_;
  at::Tensor unsharded_flat_;         // [world * gather_numel(false)] in the compute dtype, parameter-major
  at::Tensor unsharded_transformed_;  // [world * transformed_numel_] after it in the same storage
  State state_ = State::Sharded;
  std::shared_ptr<c10::Event> gathered_;     // all-gather stream, after the all-gather
  std::vector<at::Tensor> gather_buffers_;   // GatherBuffers, until the compute stream waited
  at::Tensor host_shards_;                   // cpu_offload: every padded shard, flat, in host memory
  // keep_compute_shards: the all-gather input of the parameters gathered in the compute dtype,
  // kept ([gather_numel(false)]; sharded over one rank, unsharded_flat_ itself, never freed).
  at::Tensor compute_shards_;
  // Prepared gradients awaiting the reduce-scatter, parameter-major (parameter_major_into): across
  // ranks a buffer per parameter's slot and one for the flags' slot; one rank, one flat buffer of
  // [shard_numel_ + one flag per parameter]; where reduces_each_in_place(), each parameter's
  // (undefined: it has none).
  std::vector<at::Tensor> reduce_input_;
  bool gradients_prepared_ = false;          // reduce_input_ holds this backward's, not yet reduce-scattered
  bool all_local_grads_ = false;             // this rank had every parameter's gradient
  std::vector<at::Tensor> reduced_;          // their reduce-scatter's output (offloaded: its host copy) awaiting commit
  std::shared_ptr<c10::Event> reduced_at_;   // reduce-scatter stream, after the collective (and host copy)
};

}  // namespace fsdp
