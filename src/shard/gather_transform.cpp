#include "shard/gather_transform.h"

namespace fsdp {

std::unique_ptr<GatherTransform> make_gather_transform(const std::string& name, const at::Tensor& param,
                                                       bool cpu_offload, const at::Device& device) {
  for (auto make : {make_float8_gather})
    if (auto transform = make(name, param, cpu_offload, device)) return transform;
  return nullptr;
}

}  // namespace fsdp
