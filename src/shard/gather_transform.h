// A parameter all-gathered in another form than its group's compute dtype: FSDP2's per-parameter
// pre/post all-gather hooks, as one object per parameter. The group casts the parameter's shard
// into its piece of the all-gather input (cast_in), gathers the pieces as bytes into their own part
// of the unsharded storage, and then hands the gathered rows to the transform (attach), which gives
// the parameter what its readers expect while unsharded; reshard undoes it (detach).
//
// A new format is one subclass in a file of its own, its maker declared below and listed in
// make_gather_transform (float8: float8_gather.cpp). GroupParams knows only this interface.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp {

class GatherTransform {
 public:
  virtual ~GatherTransform() = default;

  // What the gathered rows are: their element type in the all-gather (sent as bytes) and in the
  // group's unsharded storage. Every transformed parameter of one group has the same.
  virtual at::ScalarType gathered_dtype() const = 0;
  // Per gather, before the group switches to the all-gather stream (so that it comes from the
  // compute stream's pool): whatever cast_in writes beside the gathered rows. `options`: the
  // group's device.
  virtual void allocate(const at::TensorOptions& options) = 0;
  // On the all-gather stream: the padded shard (master copy) cast into `input`, this rank's piece
  // of the all-gather (its shape, gathered_dtype()).
  virtual void cast_in(const at::Tensor& padded_shard, const at::Tensor& input) = 0;
  // Right after the gather is issued (metadata only: kernels reading it are ordered after the
  // compute stream waits for the gather): `param` takes what it reads as while unsharded, given
  // its gathered rows ([full shape], gathered_dtype()); `compute` is the group's compute dtype.
  virtual void attach(at::Tensor& param, const at::Tensor& gathered, const at::TensorOptions& compute) = 0;
  // At reshard, before `param` goes back to its shard: drops what attach gave it.
  virtual void detach(const at::Tensor& param) = 0;

  // What the casts need from every rank (float8: each weight's amax), refreshed from the master
  // shards: a collective over `comm` for all of `same_kind` (this one's class, from groups on
  // `comm`, in the same order on every rank; `padded_shards[i]` is same_kind[i]'s).
  virtual void refresh(const std::vector<GatherTransform*>& same_kind, const std::vector<at::Tensor>& padded_shards,
                       Communicator& comm) = 0;
  // False until the first refresh (a group never refreshed refreshes its own at its first gather).
  virtual bool refreshed() const = 0;
};

// The transform parameter `name` (the module's tensor `param`) asks for, or null where it is gathered
// in the compute dtype. Throws std::invalid_argument where its group cannot gather it so
// (`cpu_offload`; its shape on `device`).
std::unique_ptr<GatherTransform> make_gather_transform(const std::string& name, const at::Tensor& param,
                                                       bool cpu_offload, const at::Device& device);

// The formats: each maker returns null for a parameter that does not ask for its format.
// enable_float8_all_gather's weights (fsdp/float8.h): float8 e4m3 with a tensorwise scale.
std::unique_ptr<GatherTransform> make_float8_gather(const std::string& name, const at::Tensor& param,
                                                    bool cpu_offload, const at::Device& device);

}  // namespace fsdp
