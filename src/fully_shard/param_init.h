// init_normal_'s numbers (param_init.cpp), exposed for the test that the two ways of computing
// them agree: for each element position, the sum of four 32-bit hashes of it under the seed's four
// keys, as exact doubles. On a GPU by tensor operations; on the CPU by one loop over the elements
// (the ~60 passes over int64 temporaries of the tensor operations cost ~30 s for a 110M-parameter
// model there).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

namespace fsdp::init_detail {

using StreamKeys = std::array<uint32_t, 4>;
StreamKeys stream_keys(uint64_t seed);
// The sums at `positions` (int64, 1-D), a float64 tensor of as many on the positions' device.
at::Tensor hashed_sums_by_tensor_ops(const at::Tensor& positions, const StreamKeys& keys);
// The same numbers on the CPU.
at::Tensor hashed_sums_by_loop(const at::Tensor& positions, const StreamKeys& keys);

}  // namespace fsdp::init_detail
