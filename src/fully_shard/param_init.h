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
// The sums at positions [first, first + n), a float64 tensor of n on `device`.
at::Tensor hashed_sums_by_tensor_ops(int64_t first, int64_t n, const StreamKeys& keys, const at::Device& device);
// The same numbers on the CPU.
at::Tensor hashed_sums_by_loop(int64_t first, int64_t n, const StreamKeys& keys);

}  // namespace fsdp::init_detail
