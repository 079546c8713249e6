#pragma once

#include <c10/core/ScalarType.h>

#include <memory>
#include <optional>

namespace fsdp {

class Communicator;

// Mixed precision: parameters are all-gathered and used for compute in
// param_dtype, gradients are reduce-scattered in reduce_dtype (default:
// param_dtype). The sharded master parameters, their gradients and the
// optimizer state keep the parameters' own dtype (e.g. float32).
struct MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
};

struct ShardOptions {
  // Communicator to shard over; default: the one fsdp::init() made.
  std::shared_ptr<Communicator> comm;
  // true: free the unsharded parameters after forward and all-gather them
  // again for backward (ZeRO-3). false: keep them until the group's backward
  // (more memory, one all-gather less). The root group always keeps them, as
  // its backward starts right after forward.
  bool reshard_after_forward = true;
  MixedPrecision mixed_precision;
};

}  // namespace fsdp
