// GPU-only checks, in fsdp_gpu_tests next to the shared parity/API/comm tests.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "comm/mpi_communicator.h"
#include "helpers.h"
#include "float8/gathered_weights.h"
#include "fsdp/float8.h"

namespace fsdp::testing {
namespace {

int64_t allocated_bytes() {
  c10::cuda::device_synchronize();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device().index());
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

TEST(Gpu, CudaTensorOnTheCpuBackendIsAnError) {
  MpiCommunicator cpu_only("cpu-check", std::chrono::seconds(5));
  auto t = torch::ones({4}, on_device());
  try {
    cpu_only.all_reduce(t, ReduceOp::Sum);
    FAIL() << "expected CollectiveError";
  } catch (const CollectiveError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("is a cuda tensor, but the mpi backend moves cpu tensors"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("run CUDA models with the NCCL backend"));
  }
}

// Every buffer a step allocates is freed by the end of the step: from the
// second step on (AdamW's state exists then) allocated memory returns to the
// same baseline after every step.
TEST(Gpu, AllocatedMemoryReturnsToTheSameBaselineEveryStep) {
  auto m = seeded_llama(tiny_llama());
  ShardOptions bf16;
  bf16.mixed_precision.param_dtype = torch::kBFloat16;
  bf16.mixed_precision.reduce_dtype = torch::kFloat;
  shard_blocks_and_root(m, bf16);
  torch::optim::AdamW optimizer(m->parameters(), torch::optim::AdamWOptions(1e-3));
  auto tokens = torch::randint(0, 64, {2, 17}, on_device(torch::kLong));
  std::vector<int64_t> after_step;
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    auto logits = fsdp::forward(m, tokens.narrow(1, 0, 16));
    torch::nn::functional::cross_entropy(logits.reshape({-1, 64}).to(torch::kFloat),
                                         tokens.narrow(1, 1, 16).reshape({-1}))
        .backward();
    optimizer.step();
    optimizer.zero_grad();
    after_step.push_back(allocated_bytes());
  }
  for (int step = 2; step < 5; ++step) EXPECT_EQ(after_step[step], after_step[1]) << "step " << step;
}

// CPU offload: what stays allocated on the GPU between steps is the sharded state less the
// weights and both AdamW moments (fp32, 12 bytes a sharded element; the gradients are freed by
// zero_grad either way). The allocator rounds each tensor up to 512 bytes.
TEST(Gpu, CpuOffloadKeepsWeightsAndOptimizerStateOffTheDevice) {
  auto held_after_steps = [](bool offload) {
    const int64_t before = allocated_bytes();
    auto m = seeded_llama(tiny_llama());
    ShardOptions o;
    o.cpu_offload = offload;
    shard_blocks_and_root(m, o);
    torch::optim::AdamW optimizer(m->parameters(), torch::optim::AdamWOptions(1e-3));
    auto tokens = torch::randint(0, 64, {2, 17}, on_device(torch::kLong));
    for (int step = 0; step < 2; ++step) {
      optimizer.zero_grad();
      auto logits = fsdp::forward(m, tokens.narrow(1, 0, 16));
      torch::nn::functional::cross_entropy(logits.reshape({-1, 64}), tokens.narrow(1, 1, 16).reshape({-1}))
          .backward();
      optimizer.step();
    }
    optimizer.zero_grad();
    int64_t shard_bytes = 0, tensors = 0;
    for (const auto& p : m->parameters()) shard_bytes += p.numel() * 4, ++tensors;
    return std::make_tuple(allocated_bytes() - before, shard_bytes, tensors);
  };
  const auto [on_device, shard_bytes, tensors] = held_after_steps(false);
  const int64_t offloaded = std::get<0>(held_after_steps(true));
  EXPECT_GE(on_device - offloaded, 3 * shard_bytes);
  EXPECT_LE(on_device - offloaded, 3 * (shard_bytes + 512 * tensors));
}

// The float8 casts' CUDA kernels equal the ATen reference bit for bit (scaling by a power of two
// is exact and both round to nearest even, saturating), for every layout, format and input dtype,
// row counts that are not multiples of the 64-row tiles included; the per-tensor amax kernel equals
// ATen's maximum. The scaled GEMMs on the float8
// tensor cores equal the dequantised operands' float32 product within its accumulation order and
// the bf16 output's rounding (2^-8), 2^-7 with the forward's fast accumulation. to_float8_both's
// two layouts equal the separate casts.
TEST(Gpu, Float8CastsEqualTheReferenceAndScaledGemmsTheDequantisedProducts) {
  check_float8_device(device());  // H100/H200: no error
  for (auto dtype : {torch::kFloat, torch::kBFloat16})
    for (int64_t rows : {100, 256})
      for (auto format : {Float8Format::E4M3, Float8Format::E5M2})
        for (bool per_row : {false, true})
          for (bool transposed : {false, true}) {
            const auto x = (torch::randn({rows, 96}, on_device(torch::kFloat)) *
                            torch::logspace(-2, 2, rows, 10, on_device(torch::kFloat)).unsqueeze(1)).to(dtype);
            const auto got = to_float8(x, format, per_row, transposed);
            const auto want = reference::to_float8(x, format, per_row, transposed);
            const std::string what = std::string(c10::toString(dtype)) + " rows " + std::to_string(rows) +
                                     (format == Float8Format::E4M3 ? " e4m3" : " e5m2") +
                                     (per_row ? " per row" : " whole") + (transposed ? " transposed" : "");
            EXPECT_TRUE(torch::equal(got.data.view(torch::kUInt8), want.data.view(torch::kUInt8))) << what;
            EXPECT_TRUE(torch::equal(got.inverse_scale, want.inverse_scale)) << what;
            if (per_row) continue;
            // Both layouts from one read, with one scale: each equal to its own cast.
            const auto both = to_float8_both(x, format);
            const auto& one = transposed ? both.transposed : both.plain;
            EXPECT_TRUE(torch::equal(one.data.view(torch::kUInt8), want.data.view(torch::kUInt8))) << what << " (both)";
            EXPECT_TRUE(torch::equal(one.inverse_scale, want.inverse_scale)) << what << " (both)";
          }
  // The amax kernel (per tensor) against ATen's: a maximum is exact, so equal; sizes with a tail
  // beyond the 8-element packs and large enough for many blocks.
  for (auto dtype : {torch::kFloat, torch::kBFloat16})
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{37, 20}, {4096, 3072}, {1, 4}}) {
      const auto x = (torch::randn({rows, cols}, on_device(torch::kFloat)) * 3).to(dtype);
      EXPECT_TRUE(torch::equal(float8_amax(x, false, false), x.abs().max().to(torch::kFloat)))
          << c10::toString(dtype) << " " << rows << " x " << cols;
    }
  for (bool fast : {false, true})
    for (bool per_row : {false, true}) {
      const auto a = to_float8(torch::randn({128, 256}, on_device(torch::kBFloat16)),
                                      Float8Format::E4M3, per_row, false);
      const auto b = to_float8(torch::randn({64, 256}, on_device(torch::kBFloat16)),
                                      Float8Format::E4M3, per_row, false);
      const auto got = float8_mm(a, b, torch::kBFloat16, fast).to(torch::kDouble);
      auto dequantised = [](const Float8Operand& op) {
        const auto s = op.inverse_scale.dim() == 0 ? op.inverse_scale : op.inverse_scale.unsqueeze(1);
        return op.data.to(torch::kDouble) * s.to(torch::kDouble);
      };
      const auto da = dequantised(a), db = dequantised(b);
      const auto want = torch::mm(da, db.t());
      const auto scale = torch::mm(da.abs(), db.abs().t());
      EXPECT_TRUE(((got - want).abs() <= (fast ? 0x1p-7 : 0x1p-8) * scale).all().item<bool>())
          << "fast " << fast << " per_row " << per_row << ": worst " << ((got - want).abs() / scale).max().item<double>();
    }
}

// The float8 all-gather's kernels: a shard cast with a given amax equals the reference's cast
// with it, and the float8 transpose (backward's weight) equals ATen's transposed copy, byte for
// byte, partial 64 x 64 tiles included.
TEST(Gpu, Float8AllGatherCastAndTransposeAreExact) {
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{96, 160}, {256, 64}, {16, 1040}}) {
    const auto shard = torch::randn({rows, cols}, on_device(torch::kFloat));
    const auto amax = shard.abs().max() * 3;  // the other ranks' shards hold larger values
    const auto out = torch::empty({rows, cols}, on_device(torch::kFloat8_e4m3fn));
    const auto inverse_scale = torch::empty({}, on_device(torch::kFloat));
    float8::cast_with_amax(shard, amax, out, inverse_scale);
    const auto want = reference::to_float8(shard, Float8Format::E4M3, false, false, amax);
    const std::string what = std::to_string(rows) + " x " + std::to_string(cols);
    EXPECT_TRUE(torch::equal(out.view(torch::kUInt8), want.data.view(torch::kUInt8))) << what;
    EXPECT_TRUE(torch::equal(inverse_scale, want.inverse_scale)) << what;
    EXPECT_TRUE(torch::equal(float8::transpose(out).view(torch::kUInt8).cpu(),
                             out.view(torch::kUInt8).cpu().t().contiguous()))
        << what << " transposed";
  }
}

// A float8 linear on the GPU, forward and both gradients, against the same function on CPU
// (the ATen reference: the same casts, float32 products): the casts are equal bit for bit, so
// the results differ by accumulation and the bf16 outputs' rounding, 2^-7 of |a| @ |b|^T.
TEST(Gpu, Float8LinearMatchesTheCpuReferenceInValuesAndGradients) {
  for (auto recipe : {Float8Recipe::Tensorwise, Float8Recipe::Rowwise}) {
    const auto x_cpu = torch::randn({4, 32, 128}).to(torch::kBFloat16), w_cpu = (torch::randn({96, 128}) * 0.05).to(torch::kBFloat16);
    const auto g_cpu = torch::randn({4, 32, 96}).to(torch::kBFloat16);
    std::vector<std::vector<torch::Tensor>> results;
    for (const auto& where : {c10::Device(c10::kCPU), device()}) {
      auto x = x_cpu.to(where).detach().requires_grad_(), w = w_cpu.to(where).detach().requires_grad_();
      auto y = float8_linear(x, w, recipe);
      y.backward(g_cpu.to(where));
      results.push_back({y.detach().cpu(), x.grad().cpu(), w.grad().cpu()});
    }
    const auto x2 = x_cpu.to(torch::kDouble).reshape({-1, 128}).abs(), w2 = w_cpu.to(torch::kDouble).abs();
    const auto g2 = g_cpu.to(torch::kDouble).reshape({-1, 96}).abs();
    const std::vector<torch::Tensor> scales = {torch::mm(x2, w2.t()), torch::mm(g2, w2), torch::mm(g2.t(), x2)};
    for (int i = 0; i < 3; ++i) {
      const auto error = (results[1][i].to(torch::kDouble) - results[0][i].to(torch::kDouble)).abs().reshape(scales[i].sizes());
      EXPECT_TRUE((error <= 0x1p-7 * scales[i]).all().item<bool>())
          << name_of(recipe) << " " << "y/grad_x/grad_w"[0] << i << ": worst "
          << (error / scales[i]).max().item<double>();
    }
  }
}

}  // namespace
}  // namespace fsdp::testing
