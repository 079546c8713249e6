// How errors and the cross-rank check name a reducing collective, e.g. "reduce_scatter(avg)":
// one spelling for every backend.
#pragma once

#include <string>

#include "fsdp/communicator.h"

namespace fsdp {

inline std::string reducing(const char* collective, ReduceOp op) {
  return std::string(collective) + (op == ReduceOp::Avg ? "(avg)" : "(sum)");
}

}  // namespace fsdp
