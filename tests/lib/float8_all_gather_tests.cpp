// Float8 all-gather (fsdp/float8.h, enable_float8_all_gather) on real ranks: weights gathered in
// float8 train exactly as weights gathered in fp32 and cast after, the group counts one byte per
// gathered element, and what it cannot do is refused by name.
#include "helpers.h"
#include "fsdp/float8.h"
#include "fsdp/planning.h"

namespace fsdp::testing {
namespace {

TestLlamaConfig float8_llama(bool all_gather, Float8Recipe recipe = Float8Recipe::Tensorwise) {
  auto c = tiny_llama();
  c.float8 = recipe;
  c.float8_all_gather = all_gather;
  return c;
}

int64_t qkv_rows(const TestLlamaConfig& c) { return (c.n_heads + 2 * c.n_kv_heads) * (c.dim / c.n_heads); }

std::vector<torch::Tensor> projection_weights(TestLlama& llama) {
  std::vector<torch::Tensor> out;
  for (auto& b : llama->blocks)
    for (const auto& w : {b->attn->wqkv->weight, b->attn->wo->weight, b->mlp->w_gate_up->weight, b->mlp->w_down->weight})
      out.push_back(w);
  return out;
}

// With fp32 compute, each rank's shard cast with the amax of all ranks' shards is bit for bit
// its rows of the unsharded weight cast with the whole weight's amax (the same values, the same
// power-of-two scale), and backward's float8 transpose of it the transposed cast. So the runs are
// identical step after step. Each weight's last row is made its largest, so that a shard cast with
// its own rank's amax takes another scale; and before step 2 every weight doubles, so that a
// scale not refreshed from the weights the optimizer left saturates (amax * scale > 224 always).
TEST(Float8AllGather, TrainsIdenticallyToCastingAfterTheGather) {
  auto run = [](bool all_gather) {
    auto llama = seeded_llama(float8_llama(all_gather));
    {
      torch::NoGradGuard no_grad;
      for (auto& w : projection_weights(llama)) w[w.size(0) - 1].mul_(8);
    }
    auto s = llama_setup(llama, [](TestLlama& m) { shard_blocks_and_root(m); });
    s.steps = 4;
    s.before_step = [llama](int step) mutable {
      torch::NoGradGuard no_grad;
      if (step == 2)
        for (auto& w : projection_weights(llama)) w.mul_(2);  // the shards, between steps
    };
    return train(s);
  };
  const auto cast_after = run(false), gathered = run(true);
  expect_identical_run(gathered, cast_after);
  EXPECT_LT(gathered.losses[1], gathered.losses[0]);  // it trains
}

// The projections' weights take one byte per element in the unsharded group (bf16: two), and so
// in the all-gather's buffers on several ranks; the norms stay bf16.
TEST(Float8AllGather, CountsOneBytePerGatheredElement) {
  ShardOptions bf16;
  bf16.mixed_precision.param_dtype = torch::kBFloat16;
  bf16.mixed_precision.reduce_dtype = torch::kFloat;
  auto block_memory = [&](bool all_gather) {
    auto llama = seeded_llama(float8_llama(all_gather));
    auto s = llama_setup(llama, [bf16](TestLlama& m) { shard_blocks_and_root(m, bf16); });
    s.steps = 1;
    train(s);
    for (const auto& shape : group_shapes(*llama))
      if (shape.name == "blocks.0") return shape.memory;
    ADD_FAILURE() << "no group blocks.0";
    return GroupMemory{};
  };
  const GroupMemory cast_after = block_memory(false), gathered = block_memory(true);
  const int64_t ranks = world()->world_size();
  auto padded = [ranks](int64_t rows, int64_t cols) { return (rows + ranks - 1) / ranks * ranks * cols; };
  const auto c = tiny_llama();
  const int64_t projections = padded(qkv_rows(c), c.dim) + padded(c.dim, c.dim) + padded(2 * c.ffn, c.dim) +
                              padded(c.dim, c.ffn);
  EXPECT_EQ(gathered.param_bytes, cast_after.param_bytes - projections);  // 2 bytes -> 1
  if (ranks > 1) {
    // The input, one rank's part (each gathers straight into the unsharded storage).
    EXPECT_EQ(gathered.gather_buffer_bytes, cast_after.gather_buffer_bytes - projections / ranks);
  } else {
    EXPECT_EQ(gathered.gather_buffer_bytes, 0);  // one rank gathers in place
  }
  EXPECT_EQ(gathered.grad_bytes, cast_after.grad_bytes);  // gradients keep the compute dtype
}

// While its group is unsharded, a weight gathered in float8 holds no values of its own: any reader
// but float8_linear gets NaN (a loud loss), not zeros (a plausible wrong one). The norms beside it
// are gathered as they are.
TEST(Float8AllGather, AWeightGatheredInFloat8ReadsAsNaNOutsideTheLinear) {
  auto llama = seeded_llama(float8_llama(true));
  ShardOptions kept;
  kept.reshard_after_forward = false;  // stays unsharded after forward
  shard_blocks_and_root(llama, kept);
  const auto tokens = torch::zeros({2, kLlamaSeq}, torch::TensorOptions().dtype(torch::kLong).device(device()));
  const auto logits = fsdp::forward(llama, tokens);
  EXPECT_TRUE(logits.isfinite().all().item<bool>());
  const auto& block = llama->blocks[0];
  const auto c = tiny_llama();
  EXPECT_EQ(block->attn->wqkv->weight.sizes(), torch::IntArrayRef({qkv_rows(c), c.dim}));
  EXPECT_TRUE(block->attn->wqkv->weight.isnan().all().item<bool>());
  EXPECT_TRUE(block->mlp->w_down->weight.isnan().all().item<bool>());
  EXPECT_TRUE(block->attn_norm->weight.isfinite().all().item<bool>());
}

TEST(Float8AllGather, RefusesWhatItCannotDo) {
  EXPECT_THROW(
      {
        try {
          enable_float8_all_gather(torch::zeros({4}));
        } catch (const std::invalid_argument& e) {
          EXPECT_THAT(e.what(), ::testing::HasSubstr("2-D floating weight"));
          throw;
        }
      },
      std::invalid_argument);
  {  // cpu_offload gathers the host shards as they are
    auto llama = seeded_llama(float8_llama(true));
    ShardOptions offload;
    offload.cpu_offload = true;
    try {
      fully_shard(llama->blocks[0], offload);
      ADD_FAILURE() << "fully_shard took float8 all-gather with cpu_offload";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("attn.wqkv.weight' is gathered in float8"));
      EXPECT_THAT(e.what(), ::testing::HasSubstr("cpu_offload"));
    }
  }
  if (world()->world_size() > 1) {  // marked on one rank only: the buffers would differ in size
    auto llama = seeded_llama(float8_llama(world()->rank() == 0));
    try {
      fully_shard(llama->blocks[0]);
      ADD_FAILURE() << "fully_shard took float8 marks that differ across ranks";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("the model differs across ranks"));
      EXPECT_THAT(e.what(), ::testing::HasSubstr("enable_float8_all_gather"));
    }
  }
  {  // rowwise would read the parameter, which holds no values while gathered in float8
    auto llama = seeded_llama(float8_llama(false, Float8Recipe::Rowwise));
    for (auto& block : llama->blocks) enable_float8_all_gather(block->attn->wqkv->weight);
    shard_blocks_and_root(llama);
    const auto tokens = torch::zeros({2, kLlamaSeq}, torch::TensorOptions().dtype(torch::kLong).device(device()));
    try {
      fsdp::forward(llama, tokens);
      ADD_FAILURE() << "a rowwise linear read a weight gathered in float8";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("only the tensorwise recipe reads"));
    }
  }
}

}  // namespace
}  // namespace fsdp::testing
