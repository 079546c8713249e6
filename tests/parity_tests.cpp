// FSDP training against single-process training of the same model on the
// same global batch.
#include "helpers.h"

namespace fsdp::testing {
namespace {

TrainResult reference(const model::LlamaConfig& c, double clip = 0, bool sgd = false) {
  auto s = llama_setup(seeded_llama(c));
  s.clip = clip;
  s.sgd = sgd;
  return train(s);
}

TEST(Parity, BlocksAndRootMatchSingleProcess) {
  auto want = reference(tiny_llama());
  auto got = train(llama_setup(seeded_llama(tiny_llama()), [](model::Llama& m) { shard_blocks_and_root(m); }));
  expect_same_run(got, want);
  EXPECT_LT(got.losses.back(), got.losses.front());  // it trains
}

TEST(Parity, SgdMatchesSingleProcessClosely) {
  auto want = reference(tiny_llama(), 0, /*sgd=*/true);
  auto s = llama_setup(seeded_llama(tiny_llama()), [](model::Llama& m) { shard_blocks_and_root(m); });
  s.sgd = true;
  auto got = train(s);
  expect_same_run(got, want, kSgdTolerance);
  EXPECT_LT(got.losses.back(), got.losses.front());
}

// Two backward passes before the step: the second reduce-scatter adds to the
// sharded gradients of the first.
TEST(Parity, GradientAccumulationMatchesOneBigBatch) {
  auto want = reference(tiny_llama(), 0, /*sgd=*/true);
  auto s = llama_setup(seeded_llama(tiny_llama()), [](model::Llama& m) { shard_blocks_and_root(m); });
  s.sgd = true;
  s.micro_batches = 2;
  expect_same_run(train(s), want, kSgdTolerance);
}

TEST(Parity, NestedGroupsMatchSingleProcess) {
  auto want = reference(tiny_llama());
  auto got = train(llama_setup(seeded_llama(tiny_llama()), [](model::Llama& m) {
    for (auto& b : m->blocks) {
      fully_shard(b->attn);
      fully_shard(b->mlp);
      fully_shard(b->attn_norm);
      fully_shard(b);  // what is left of the block: mlp_norm
    }
    fully_shard(m);
  }));
  expect_same_run(got, want);
}

TEST(Parity, RootOnlyMatchesSingleProcess) {
  auto want = reference(tiny_llama());
  auto got = train(llama_setup(seeded_llama(tiny_llama()), [](model::Llama& m) { fully_shard(m); }));
  expect_same_run(got, want);
}

TEST(Parity, OptimizerCreatedBeforeShardingTrainsIdentically) {
  auto shard = [](model::Llama& m) { shard_blocks_and_root(m); };
  auto after = train(llama_setup(seeded_llama(tiny_llama()), shard));
  auto before_setup = llama_setup(seeded_llama(tiny_llama()), shard);
  before_setup.optimizer_before_shard = true;
  auto before = train(before_setup);
  expect_identical_run(before, after);
  EXPECT_LT(before.losses.back(), before.losses.front());
}

TEST(Parity, ReshardAfterForwardOffGivesIdenticalNumbers) {
  auto on = train(llama_setup(seeded_llama(tiny_llama()), [](model::Llama& m) { shard_blocks_and_root(m); }));
  ShardOptions keep;
  keep.reshard_after_forward = false;
  auto off = train(llama_setup(seeded_llama(tiny_llama()), [keep](model::Llama& m) { shard_blocks_and_root(m, keep); }));
  expect_identical_run(off, on);
}

TEST(Parity, TiedEmbeddingAndHeadInOneGroup) {
  auto c = tiny_llama();
  c.tie_embeddings = true;
  auto want = reference(c);
  auto got = train(llama_setup(seeded_llama(c), [](model::Llama& m) { shard_blocks_and_root(m); }));
  expect_same_run(got, want);
}

TEST(Parity, GradientClippingMatchesSingleProcessNorm) {
  const double clip = 0.05;  // small enough to clip every step
  auto want = reference(tiny_llama(), clip);
  auto s = llama_setup(seeded_llama(tiny_llama()), [](model::Llama& m) { shard_blocks_and_root(m); });
  s.clip = clip;
  auto got = train(s);
  ASSERT_EQ(got.grad_norms.size(), want.grad_norms.size());
  for (size_t i = 0; i < got.grad_norms.size(); ++i) {
    EXPECT_GT(want.grad_norms[i], clip);
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], 1e-5 * want.grad_norms[i]);
  }
  expect_same_run(got, want);
}

TEST(Parity, ToyNetWithUnusedFrozenAndTinyParameters) {
  auto setup = [](std::function<void(ToyNet&)> shard) {
    torch::manual_seed(11);
    ToyNet net;
    net->to(device());
    TrainSetup s;
    s.module = net.ptr();
    s.rows_per_rank = 3;
    s.loss = [net](int64_t step, int64_t first, int64_t count) mutable {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
      auto x = torch::randn({64, 7}, gen).narrow(0, first, count).to(device());
      auto y = torch::randn({64, 1}, gen).narrow(0, first, count).to(device());
      return torch::mse_loss(fsdp::forward(net, x), y);
    };
    if (shard) s.shard = [net, shard]() mutable { shard(net); };
    return s;
  };
  auto want = train(setup({}));
  auto got = train(setup([](ToyNet& n) {
    fully_shard(n->first);
    fully_shard(n->frozen);
    fully_shard(n->last);
    fully_shard(n);  // scale and the unused layer
  }));
  expect_same_run(got, want);
  EXPECT_EQ(want.params_without_grad,
            (std::vector<std::string>{"frozen.weight", "unused.weight", "unused.bias"}));
}

TEST(Parity, Bf16MixedPrecisionTracksFp32) {
  auto want = reference(tiny_llama());
  ShardOptions bf16;
  bf16.mixed_precision.param_dtype = torch::kBFloat16;
  bf16.mixed_precision.reduce_dtype = torch::kFloat;
  auto llama = seeded_llama(tiny_llama());
  auto got = train(llama_setup(llama, [bf16](model::Llama& m) { shard_blocks_and_root(m, bf16); }));
  // bf16 keeps 8 bits of mantissa: losses agree to about 1%.
  for (size_t i = 0; i < got.losses.size(); ++i) EXPECT_NEAR(got.losses[i], want.losses[i], 0.02 * want.losses[i]);
  for (const auto& item : llama->named_parameters()) {
    EXPECT_EQ(item.value().scalar_type(), torch::kFloat) << item.key() << " (sharded master stays fp32)";
    EXPECT_EQ(item.value().grad().scalar_type(), torch::kFloat) << item.key();
  }
}

}  // namespace
}  // namespace fsdp::testing
