// Initialisation that does not depend on how a parameter is sharded (fully_shard.h).
#include "fully_shard/param_init.h"

#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <stdexcept>

#include "fsdp/fully_shard.h"
#include "fsdp/tensor_parallel.h"
#include "runtime/group_state.h"
#include "runtime/runtime.h"

namespace fsdp {
namespace {

constexpr int64_t kLow32 = 0xffffffffll;
// A 32-bit integer mixer: xor-shift-multiply with constants from Wellons' hash prospector. Both
// multipliers are below 2^31, so on int64 lanes holding 32-bit values no product reaches 2^63.
constexpr int kShift1 = 16, kShift2 = 15, kShift3 = 15;
constexpr int64_t kMultiplier1 = 0x21f0aaad, kMultiplier2 = 0x735a2d97;

at::Tensor mix32(at::Tensor x) {
  x = x.bitwise_xor(x.bitwise_right_shift(kShift1));
  x = x.mul(kMultiplier1).bitwise_and(kLow32);
  x = x.bitwise_xor(x.bitwise_right_shift(kShift2));
  x = x.mul(kMultiplier2).bitwise_and(kLow32);
  return x.bitwise_xor(x.bitwise_right_shift(kShift3));
}

// The same mixer on one number (the per-stream keys).
uint32_t mix32(uint64_t x) {
  x &= kLow32;
  x ^= x >> kShift1;
  x = (x * kMultiplier1) & kLow32;
  x ^= x >> kShift2;
  x = (x * kMultiplier2) & kLow32;
  return static_cast<uint32_t>(x ^ (x >> kShift3));
}

// Elements per chunk: bounds the int64 temporaries (8 bytes each, a few alive at once).
constexpr int64_t kChunk = int64_t(1) << 24;

}  // namespace

namespace init_detail {

StreamKeys stream_keys(uint64_t seed) {
  StreamKeys keys;
  for (uint32_t k = 0; k < 4; ++k) keys[k] = mix32(mix32(seed) ^ mix32((seed >> 32) + 0x9e3779b9u * (k + 1)));
  return keys;
}

at::Tensor hashed_sums_by_tensor_ops(const at::Tensor& position, const StreamKeys& keys) {
  at::Tensor sum;
  for (uint32_t key : keys) {
    at::Tensor u = mix32(mix32(position.bitwise_xor(int64_t(key))).bitwise_xor(int64_t(mix32(key)))).to(at::kDouble);
    sum = sum.defined() ? sum.add_(u) : u;
  }
  return sum;
}

at::Tensor hashed_sums_by_loop(const at::Tensor& positions, const StreamKeys& keys) {
  StreamKeys mixed;
  for (size_t k = 0; k < keys.size(); ++k) mixed[k] = mix32(keys[k]);
  const at::Tensor in = positions.contiguous();
  const int64_t* at_position = in.data_ptr<int64_t>();
  at::Tensor sum = at::empty({in.numel()}, at::kDouble);
  double* out = sum.data_ptr<double>();
  at::parallel_for(0, in.numel(), int64_t(1) << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t position = static_cast<uint64_t>(at_position[i]);
      double total = 0;  // exact: four integers below 2^32
      for (size_t k = 0; k < keys.size(); ++k) total += mix32(uint64_t(mix32(position ^ keys[k])) ^ mixed[k]);
      out[i] = total;
    }
  });
  return sum;
}

}  // namespace init_detail

at::Tensor deferred_parameter(at::IntArrayRef shape, const at::TensorOptions& options) {
  return at::zeros({}, options).expand(shape);
}

namespace {

// The positions in the full parameter of a shard's elements [first, first + n) (flat, in the
// tensor fully_shard sharded): themselves, or for a tensor-parallel part their places in the full
// tensor it is a part of.
at::Tensor full_positions(const TpPart* part, int64_t first, int64_t n, const at::Device& device) {
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor flat = at::arange(first, first + n, options);
  if (!part) return flat;
  const int64_t part_columns = part->part_shape()[1], full_columns = part->full_shape[1];
  at::Tensor row = flat.div(part_columns, "floor"), column = flat.remainder(part_columns);
  const at::Tensor full_index = part->indices_of(part->tp->rank()).to(device);
  if (part->dim == 0)
    row = full_index.index_select(0, row);
  else
    column = full_index.index_select(0, column);
  return row.mul_(full_columns).add_(column);
}

}  // namespace

void init_normal_(const at::Tensor& param, uint64_t seed, double std) {
  c10::NoGradGuard no_grad;
  const ShardRows where = shard_rows_of(param);
  const TpPart* part = tp_part_of(param);
  const int64_t first = where.first_row * where.row_numel();
  const int64_t count = where.rows * where.row_numel();
  int64_t full = 1;
  for (int64_t size : part ? part->full_shape : where.full_shape) full *= size;
  if (full > kLow32)
    throw std::invalid_argument("fsdp::init_normal_: a parameter of " + std::to_string(full) +
                                " elements; positions are hashed as 32-bit numbers (at most 2^32 elements)");
  if (param.numel() != count || !param.is_contiguous())
    throw std::invalid_argument("fsdp::init_normal_: the parameter is not a contiguous tensor of its shard's "
                                "elements (a deferred parameter must be sharded before it is filled)");
  // Four keyed streams; each uniform is an exact multiple of 2^-32 and their sum, shift and scale
  // are correctly rounded float64 operations: the same bits whatever the kernel or the chunking.
  const init_detail::StreamKeys keys = init_detail::stream_keys(seed);
  const double scale = std * std::sqrt(3.0) / 4294967296.0;  // Irwin-Hall(4) has variance 4/12
  at::Tensor flat = param.view(-1);
  // Computed where the group computes (an offloaded shard lives on the host, the values are the same).
  const auto owner = Runtime::get().owner_of(param);
  const at::Device device = owner ? owner->state->params().device() : param.device();
  for (int64_t begin = 0; begin < count; begin += kChunk) {
    const int64_t n = std::min(kChunk, count - begin);
    const at::Tensor positions = full_positions(part, first + begin, n, device);
    at::Tensor sum = device.is_cpu() ? init_detail::hashed_sums_by_loop(positions, keys)
                                     : init_detail::hashed_sums_by_tensor_ops(positions, keys);
    flat.narrow(0, begin, n).copy_(sum.sub_(2.0 * 4294967296.0).mul_(scale).to(flat.scalar_type()));
  }
}

}  // namespace fsdp
