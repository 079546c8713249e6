// ShardOptions::keep_compute_shards: the all-gather sends each shard's kept compute-dtype copy,
// made again only when the master changed (an in-place op, a checkpoint load), or as an optimizer
// wrote it (mark_compute_shards_written). What a rank gathers shows which copy went out.
#include "helpers.h"
#include "io/files.h"

namespace fsdp::testing {
namespace {

using ::testing::HasSubstr;

// One weight of 6 rows (uneven over 4 ranks: the last shard is padding), gathered by a forward
// that returns it; inside a root of its own, so it reshards after each forward.
struct Weight : torch::nn::Module {
  explicit Weight(const at::Tensor& full) { weight = register_parameter("weight", full.clone()); }
  at::Tensor forward(const at::Tensor& x) { return weight * x; }
  at::Tensor weight;
};
struct Outer : torch::nn::Module {
  explicit Outer(const at::Tensor& full) : inner(register_module("inner", std::make_shared<Weight>(full))) {}
  at::Tensor forward(const at::Tensor& x) { return fsdp::forward(inner, x); }
  std::shared_ptr<Weight> inner;
};

TEST(ComputeShards, TheAllGatherSendsTheKeptCopyUntilTheMasterChanges) {
  // Values bf16 rounds (0.1 + 0.37 k): a copy made by a cast differs from the master.
  const at::Tensor master = at::arange(24, on_device()).mul_(0.37).add_(0.1).view({6, 4});
  auto model = std::make_shared<Outer>(master);
  ShardOptions o;
  o.mixed_precision.param_dtype = at::kBFloat16;
  o.keep_compute_shards = true;
  fully_shard(*model->inner, o);
  fully_shard(*model);
  at::Tensor& weight = model->inner->weight;
  const at::Tensor copy = compute_shard_of(weight);
  ASSERT_TRUE(copy.defined());
  EXPECT_EQ(copy.scalar_type(), at::kBFloat16);
  EXPECT_EQ(copy.sizes(), weight.sizes());
  const auto gathered = [&] {
    c10::NoGradGuard no_grad;
    return fsdp::forward(model, at::ones({}, on_device(at::kBFloat16)));
  };
  EXPECT_TRUE(at::equal(gathered(), master.to(at::kBFloat16)));
  // The master unchanged: the copy goes out as it is (here overwritten behind the runtime's back).
  copy.fill_(5);
  EXPECT_TRUE(at::equal(gathered(), at::full({6, 4}, 5, on_device(at::kBFloat16))));
  // An optimizer's write, marked: sent as written.
  copy.fill_(3);
  mark_compute_shards_written({weight});
  EXPECT_TRUE(at::equal(gathered(), at::full({6, 4}, 3, on_device(at::kBFloat16))));
  // The master changed in place: cast again.
  {
    c10::NoGradGuard no_grad;
    weight.mul_(2);
  }
  EXPECT_TRUE(at::equal(gathered(), master.mul(2).to(at::kBFloat16)));
  // A checkpoint load (on CPU ranks read straight into the shard's memory) changes it too.
  CheckpointState state = model_state(*model);
  const std::string dir = shared_dir("compute_shards");
  save_checkpoint(dir, state);
  {
    c10::NoGradGuard no_grad;
    weight.mul_(3);
  }
  EXPECT_TRUE(at::equal(gathered(), master.mul(6).to(at::kBFloat16)));
  load_checkpoint(dir, state);
  EXPECT_TRUE(at::equal(gathered(), master.mul(2).to(at::kBFloat16)));
  world()->barrier();
  if (world()->rank() == 0) io::remove_tree(dir);
}

TEST(ComputeShards, MisuseIsAnError) {
  auto plain = std::make_shared<Weight>(at::ones({4, 2}, on_device()));
  fully_shard(*plain);
  EXPECT_FALSE(compute_shard_of(plain->weight).defined());
  try {
    mark_compute_shards_written({plain->weight});
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("a parameter whose group keeps no compute shards"));
  }
  auto offloaded = std::make_shared<Weight>(at::ones({4, 2}, on_device()));
  ShardOptions o;
  o.keep_compute_shards = o.cpu_offload = true;
  try {
    fully_shard(*offloaded, o);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("keep_compute_shards keeps device copies of the shards, and cpu_offload"));
  }
}

}  // namespace
}  // namespace fsdp::testing
