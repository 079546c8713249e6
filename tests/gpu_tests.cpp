// GPU-only checks, in fsdp_gpu_tests next to the shared parity/API/comm tests.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "comm/mpi_communicator.h"
#include "helpers.h"

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

}  // namespace
}  // namespace fsdp::testing
