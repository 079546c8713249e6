// Deprecated since 0.5.0: activation recomputation is fsdp::recompute in fsdp/recompute.h (the
// old name read like saving state, which is fsdp/sharded_checkpoint.h). This header and
// fsdp::checkpoint stay for one version.
#pragma once

#include "fsdp/recompute.h"

namespace fsdp {

/// Deprecated: fsdp::recompute (fsdp/recompute.h), under its old name.
template <class M, class... Ts>
[[deprecated("fsdp::checkpoint is fsdp::recompute (fsdp/recompute.h) since fsdp.cpp 0.5.0")]] at::Tensor checkpoint(
    M& module, const Ts&... args) {
  return recompute(module, args...);
}

}  // namespace fsdp
