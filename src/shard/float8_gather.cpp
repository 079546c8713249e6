// Float8 all-gather (enable_float8_all_gather): each marked weight's shard is cast to float8 e4m3
// with the power-of-two scale of its amax over all ranks, gathered at one byte an element, and
// handed to float8_linear (src/float8/gathered_weights.h) with its inverse scale, so the GEMM
// reads it without casting the gathered weight again: torchtitan's tensorwise recipe with float8
// all-gather, as FSDP2's Float8Linear weights do through their pre/post all-gather hooks.
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "float8/gathered_weights.h"
#include "fsdp/float8.h"
#include "shard/gather_transform.h"

namespace fsdp {
namespace {

class Float8Gather final : public GatherTransform {
 public:
  at::ScalarType gathered_dtype() const override { return at::kFloat8_e4m3fn; }

  // 16 bytes: cuBLASLt takes a scale only at a 16-byte aligned address.
  void allocate(const at::TensorOptions& options) override {
    inverse_scale_ = at::empty({4}, options.dtype(at::kFloat));
  }

  void cast_in(const at::Tensor& padded_shard, const at::Tensor& input) override {
    float8::cast_with_amax(padded_shard, amax_, input, inverse_scale_[0]);
  }

  // The parameter reads as NaN, not zero, while its float8 copy is gathered: a reader other than
  // float8_linear (a weight tied to another module, a hook) gets a NaN loss that stops training
  // rather than a plausible wrong one. No memory: one element, expanded.
  void attach(at::Tensor& param, const at::Tensor& gathered, const at::TensorOptions& compute) override {
    param.set_data(at::full({}, std::numeric_limits<double>::quiet_NaN(), compute).expand(gathered.sizes()));
    float8::set_gathered(param, {gathered, inverse_scale_[0]});
  }

  void detach(const at::Tensor& param) override {
    float8::clear_gathered(param);
    inverse_scale_ = at::Tensor();
  }

  // One small all-gather for every weight of `same_kind`: each one's amax over its own rows, then
  // the largest over the ranks.
  void refresh(const std::vector<GatherTransform*>& same_kind, const std::vector<at::Tensor>& padded_shards,
               Communicator& comm) override {
    at::Tensor amax = at::stack(at::_foreach_norm(padded_shards, INFINITY)).to(at::kFloat);
    if (comm.world_size() > 1) {
      at::Tensor all = at::empty({comm.world_size() * amax.numel()}, amax.options());
      comm.all_gather(all, amax);
      amax = at::amax(all.view({comm.world_size(), amax.numel()}), {0});
    }
    for (size_t i = 0; i < same_kind.size(); ++i)
      static_cast<Float8Gather*>(same_kind[i])->amax_ = amax[static_cast<int64_t>(i)];
  }

  bool refreshed() const override { return amax_.defined(); }

 private:
  at::Tensor amax_;           // float32 []: over all ranks, as of the last refresh
  at::Tensor inverse_scale_;  // float32 [4], this gather's in element 0, until detach
};

}  // namespace

std::unique_ptr<GatherTransform> make_float8_gather(const std::string& name, const at::Tensor& param,
                                                    bool cpu_offload, const at::Device& device) {
  if (!float8_all_gather_enabled(param)) return nullptr;
  if (cpu_offload)
    throw std::invalid_argument("fsdp::fully_shard: parameter '" + name + "' is gathered in float8 "
                                "(enable_float8_all_gather), which a group with cpu_offload cannot do: "
                                "drop one of the two for it");
  if (device.is_cuda() && param.size(1) % 16 != 0)
    throw std::invalid_argument("fsdp::fully_shard: parameter '" + name + "' has " + std::to_string(param.size(1)) +
                                " columns; float8 all-gather on GPUs needs a multiple of 16 (the float8 "
                                "GEMMs' rule): do not call enable_float8_all_gather on it");
  return std::make_unique<Float8Gather>();
}

}  // namespace fsdp
