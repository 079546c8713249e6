// FSDP training against single-process training of the same model on the
// same global batch.
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_set>

#include "helpers.h"
#include "fsdp/memory_stats.h"

namespace fsdp::testing {
namespace {

TrainResult reference(const TestLlamaConfig& c, double clip = 0, bool sgd = false) {
  auto s = llama_setup(seeded_llama(c));
  s.clip = clip;
  s.sgd = sgd;
  return train(s);
}

TEST(Parity, BlocksAndRootMatchSingleProcess) {
  auto want = reference(tiny_llama());
  auto got = train(llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { shard_blocks_and_root(m); }));
  expect_same_run(got, want);
  EXPECT_LT(got.losses.back(), got.losses.front());  // it trains
}

// The bounds of helpers.h are loose enough for any machine's rounding, and tight enough that a
// learning rate off by 1% in a sharded run (for SGD and AdamW) falls outside them.
TEST(Parity, TolerancesCatchASmallError) {
  for (bool sgd : {true, false}) {
    auto want = reference(tiny_llama(), 0, sgd);
    auto s = llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { shard_blocks_and_root(m); });
    s.sgd = sgd;
    s.lr_scale = 1.01;
    EXPECT_THAT(run_differences(train(s), want), ::testing::Not(::testing::IsEmpty())) << (sgd ? "SGD" : "AdamW");
  }
}

TEST(Parity, SgdMatchesSingleProcessClosely) {
  auto want = reference(tiny_llama(), 0, /*sgd=*/true);
  auto s = llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { shard_blocks_and_root(m); });
  s.sgd = true;
  auto got = train(s);
  expect_same_run(got, want);
  EXPECT_LT(got.losses.back(), got.losses.front());
}

// Two backward passes before the step: the second reduce-scatter adds to the
// sharded gradients of the first.
TEST(Parity, GradientAccumulationMatchesOneBigBatch) {
  auto want = reference(tiny_llama(), 0, /*sgd=*/true);
  auto s = llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { shard_blocks_and_root(m); });
  s.sgd = true;
  s.micro_batches = 2;
  expect_same_run(train(s), want);
}

// The same with the reduce-scatter only after the last of three micro-batches: the groups hold
// their gradients unsharded (fp32 sums) until then. The split adds one sum of three terms per
// gradient, within the slack of the bounds (helpers.h: λ = 10 covers sums the chain depth
// does not count).
TEST(Parity, GradientAccumulationWithoutSyncMatchesOneBigBatch) {
  for (bool sgd : {true, false}) {
    SCOPED_TRACE(sgd ? "SGD" : "AdamW");
    auto reference = llama_setup(seeded_llama(tiny_llama()));
    reference.sgd = sgd;
    reference.rows_per_rank = 3;
    const auto want = train(reference);
    auto s = llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { shard_blocks_and_root(m); });
    s.sgd = sgd;
    s.rows_per_rank = 3;
    s.micro_batches = 3;
    s.sync_every_micro_batch = false;
    expect_same_run(train(s), want);
  }
}

TEST(Parity, NestedGroupsMatchSingleProcess) {
  auto want = reference(tiny_llama());
  auto got = train(llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) {
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
  auto got = train(llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { fully_shard(m); }));
  expect_same_run(got, want);
}

TEST(Parity, OptimizerCreatedBeforeShardingTrainsIdentically) {
  auto shard = [](TestLlama& m) { shard_blocks_and_root(m); };
  auto after = train(llama_setup(seeded_llama(tiny_llama()), shard));
  auto before_setup = llama_setup(seeded_llama(tiny_llama()), shard);
  before_setup.optimizer_before_shard = true;
  auto before = train(before_setup);
  expect_identical_run(before, after);
  EXPECT_LT(before.losses.back(), before.losses.front());
}

TEST(Parity, ReshardAfterForwardOffGivesIdenticalNumbers) {
  auto on = train(llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { shard_blocks_and_root(m); }));
  ShardOptions keep;
  keep.reshard_after_forward = false;
  auto off = train(llama_setup(seeded_llama(tiny_llama()), [keep](TestLlama& m) { shard_blocks_and_root(m, keep); }));
  expect_identical_run(off, on);
}

TEST(Parity, TiedEmbeddingAndHeadInOneGroup) {
  auto c = tiny_llama();
  c.tie_embeddings = true;
  auto want = reference(c);
  auto got = train(llama_setup(seeded_llama(c), [](TestLlama& m) { shard_blocks_and_root(m); }));
  expect_same_run(got, want);
}

TEST(Parity, GradientClippingMatchesSingleProcessNorm) {
  const double clip = 0.05;  // small enough to clip every step
  auto want = reference(tiny_llama(), clip);
  auto s = llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { shard_blocks_and_root(m); });
  s.clip = clip;
  auto got = train(s);
  ASSERT_EQ(got.grad_norms.size(), want.grad_norms.size());
  for (double norm : want.grad_norms) EXPECT_GT(norm, clip);
  expect_same_run(got, want);  // the norms too
}

TEST(Parity, ToyNetWithUnusedFrozenAndTinyParameters) {
  auto setup = [](std::function<void(ToyNet&)> shard) {
    torch::manual_seed(11);
    ToyNet net;
    net->to(device());
    TrainSetup s;
    s.module = net.ptr();
    s.rows_per_rank = 3;
    // first, relu, frozen, residual, last, scale, mean squared error; twice for backward.
    s.chain_depth = 2 * 7;
    s.longest_sum = [](int64_t rows) { return std::max<int64_t>(rows, 10); };
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
  for (bool offload : {false, true}) {  // offloaded: the has-gradient flags are read on the host
    SCOPED_TRACE(offload ? "CPU offload" : "on the device");
    ShardOptions o;
    o.cpu_offload = offload;
    auto got = train(setup([o](ToyNet& n) {
      fully_shard(n->first, o);
      fully_shard(n->frozen, o);
      fully_shard(n->last, o);
      fully_shard(n, o);  // scale and the unused layer
    }));
    expect_same_run(got, want);
  }
  EXPECT_EQ(want.params_without_grad,
            (std::vector<std::string>{"frozen.weight", "unused.weight", "unused.bias"}));
}

TEST(Parity, Bf16MixedPrecisionTracksFp32) {
  auto want = reference(tiny_llama());
  for (bool offload : {false, true}) {  // offloaded: fp32 shards copied in, then cast on the device
    SCOPED_TRACE(offload ? "CPU offload" : "on the device");
    ShardOptions bf16;
    bf16.mixed_precision.param_dtype = torch::kBFloat16;
    bf16.mixed_precision.reduce_dtype = torch::kFloat;
    bf16.cpu_offload = offload;
    auto llama = seeded_llama(tiny_llama());
    auto got = train(llama_setup(llama, [bf16](TestLlama& m) { shard_blocks_and_root(m, bf16); }));
    // bf16 rounds the gathered parameters and every activation to 8 significant bits (u = 2^-8);
    // a token's loss goes through D such roundings, independent errors adding to sqrt(D) * u
    // relative (about 2.5% for the tiny model's D = 44), and the mean over the batch's tokens only
    // shrinks that. Steps inherit the earlier steps' differences, as in fp32: (t + 1) times.
    const double bf16_eps = std::sqrt(static_cast<double>(llama_setup(llama).chain_depth)) * 0x1p-8;
    for (size_t i = 0; i < got.losses.size(); ++i)
      EXPECT_NEAR(got.losses[i], want.losses[i], (i + 1) * bf16_eps * want.losses[i]) << "step " << i;
    for (const auto& item : llama->named_parameters()) {
      EXPECT_EQ(item.value().scalar_type(), torch::kFloat) << item.key() << " (sharded master stays fp32)";
      EXPECT_EQ(item.value().grad().scalar_type(), torch::kFloat) << item.key();
    }
  }
}

// CPU offload changes where shards, gradients and optimizer state live, never the numbers. On
// GPUs the optimizer steps on the host: ATen's CPU AdamW rounds differently from the device's,
// within the reference's bounds (each update is a few correctly rounded fp32 operations either
// way). With clipping (norms summed over both devices' gradients) and two micro-batches (the
// second reduce-scatter's host copy added to the first). On CPU ranks the arithmetic is the
// same as without offload, so the runs must be bit-identical.
TEST(Parity, CpuOffloadMatchesSingleProcess) {
  const double clip = 0.05;  // small enough to clip every step
  auto want = reference(tiny_llama(), clip);
  auto setup = [clip](bool offload) {
    ShardOptions o;
    o.cpu_offload = offload;
    auto s = llama_setup(seeded_llama(tiny_llama()), [o](TestLlama& m) { shard_blocks_and_root(m, o); });
    s.clip = clip;
    s.micro_batches = 2;
    return s;
  };
  auto offloaded = setup(true);
  auto got = train(offloaded);
  expect_same_run(got, want);
  EXPECT_LT(got.losses.back(), got.losses.front());
  for (const auto& item : offloaded.module->named_parameters()) {
    EXPECT_TRUE(item.value().device().is_cpu()) << item.key() << " is on " << item.value().device();
    EXPECT_TRUE(item.value().grad().device().is_cpu()) << item.key() << "'s gradient";
  }
  if (device().is_cpu()) expect_identical_run(got, train(setup(false)));
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

// Runs two layers in an order that flips every step, so each recorded order
// is wrong for the next step: prefetch must fall back without a wrong,
// missing or duplicate all-gather.
class FlippingNetImpl : public torch::nn::Module {
 public:
  FlippingNetImpl() {
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
    c = register_module("c", torch::nn::Linear(6, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, int64_t step) {
    auto h = step % 2 ? fsdp::forward(b, torch::tanh(fsdp::forward(a, x)))
                      : fsdp::forward(a, torch::tanh(fsdp::forward(b, x)));
    return fsdp::forward(c, torch::tanh(h));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(FlippingNet);

TEST(Parity, ChangingOrderFallsBackSafely) {
  auto setup = [](bool sharded) {
    torch::manual_seed(3);
    FlippingNet net;
    net->to(device());
    TrainSetup s;
    s.module = net.ptr();
    s.steps = 6;
    s.sgd = true;
    // Three linears with tanh, square, mean; twice for backward.
    s.chain_depth = 2 * 7;
    s.longest_sum = [](int64_t rows) { return std::max<int64_t>(rows, 6); };
    s.loss = [net](int64_t step, int64_t first, int64_t count) mutable {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + step);
      auto x = torch::randn({32, 6}, gen).narrow(0, first, count).to(device());
      return fsdp::forward(net, x, step).pow(2).mean();
    };
    if (sharded)
      s.shard = [net]() mutable {
        fully_shard(net->a);
        fully_shard(net->b);
        fully_shard(net->c);
        fully_shard(net);
      };
    return s;
  };
  const long departures = runtime_stats().order_departures;
  auto want = train(setup(false));
  auto got = train(setup(true));
  expect_same_run(got, want);
  EXPECT_GE(runtime_stats().order_departures - departures, 4);
}

// Recomputed blocks must find their parameters, keep them until their
// gradients are reduced, and leave the recorded forward order alone.
TEST(Parity, ActivationCheckpointingMatchesSingleProcess) {
  auto want = reference(tiny_llama(), 0, /*sgd=*/true);
  auto c = tiny_llama();
  c.recompute_blocks = true;
  auto s = llama_setup(seeded_llama(c), [](TestLlama& m) { shard_blocks_and_root(m); });
  s.sgd = true;
  expect_same_run(train(s), want);
  // With the order recorded, further steps follow it and are prefetched.
  const auto before = runtime_stats();
  for (int step = 0; step < 2; ++step)
    s.loss(0, world()->rank() * s.rows_per_rank, s.rows_per_rank).backward();
  EXPECT_EQ(runtime_stats().order_departures, before.order_departures);
  EXPECT_GT(runtime_stats().prefetches, before.prefetches);
}

// A schedule as the planner makes them (block 0 recomputed, block 1 kept unsharded from forward
// to backward, prefetch 2, one collective of each kind in flight) changes memory and time, never
// what is computed: the single-process run's numbers, as with every block recomputed.
TEST(Parity, AppliedScheduleMatchesSingleProcess) {
  const RuntimeOptions defaults = runtime_options();
  auto want = reference(tiny_llama(), 0, /*sgd=*/true);
  auto s = llama_setup(seeded_llama(tiny_llama()), [&defaults](TestLlama& m) {
    plan::Schedule schedule = plan::default_schedule(m->blocks.size() + 1);
    schedule.recompute[1] = true;
    schedule.reshard_after_forward[2] = false;
    schedule.runtime.prefetch_depth = 2;
    schedule.runtime.max_inflight_allgathers = schedule.runtime.max_inflight_reduce_scatters = 1;
    shard_with_schedule(m, schedule);
    EXPECT_EQ(m->config.recomputed_blocks, std::vector<int64_t>{0});
    EXPECT_EQ(runtime_options(*state_of(*m)).prefetch_depth, 2);
    EXPECT_EQ(runtime_options().prefetch_depth, defaults.prefetch_depth);  // the root's, not the default
  });
  s.sgd = true;
  expect_same_run(train(s), want);
  set_runtime_options(defaults);
}

// A recomputed block kept unsharded from forward to backward is gathered once a step: its
// forward runs without autograd, yet its recompute comes, so its parameters stay (they used to
// be resharded and gathered again for the recompute). Same numbers as the single process.
TEST(Parity, CheckpointedBlockKeptUnshardedIsGatheredOncePerStep) {
  auto want = reference(tiny_llama(), 0, /*sgd=*/true);
  auto run = [&](bool reshard_blocks, long* gathers) {
    const long before = runtime_stats().all_gathers;
    auto s = llama_setup(seeded_llama(tiny_llama()), [reshard_blocks](TestLlama& m) {
      plan::Schedule schedule = plan::default_schedule(m->blocks.size() + 1);
      std::fill(schedule.recompute.begin() + 1, schedule.recompute.end(), true);
      std::fill(schedule.reshard_after_forward.begin() + 1, schedule.reshard_after_forward.end(), reshard_blocks);
      shard_with_schedule(m, schedule);
    });
    s.sgd = true;
    expect_same_run(train(s), want);
    *gathers = runtime_stats().all_gathers - before;
    return s.steps;
  };
  long resharded = 0, kept = 0;
  run(true, &resharded);
  const int steps = run(false, &kept);
  const int blocks = static_cast<int>(tiny_llama().n_layers);
  EXPECT_EQ(kept, steps * (1 + blocks)) << "the root and each block once a step";
  EXPECT_EQ(resharded, steps * (1 + 2 * blocks)) << "each block again for its recompute";
  set_runtime_options({});
}

// Prefetch depth and the in-flight caps change when work is issued, never
// what is computed.
TEST(Parity, PrefetchDepthAndCapsGiveIdenticalNumbers) {
  const RuntimeOptions defaults = runtime_options();
  auto run = [](RuntimeOptions o) {
    set_runtime_options(o);
    return train(llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) { shard_blocks_and_root(m); }));
  };
  const long prefetches = runtime_stats().prefetches;
  auto base = run(defaults);
  EXPECT_GT(runtime_stats().prefetches, prefetches) << "steps after the first prefetch";
  for (RuntimeOptions o : {RuntimeOptions{0, 0, 0}, RuntimeOptions{2, 1, 1}, RuntimeOptions{3, 0, 0},
                           RuntimeOptions{1, 2, 2, 1.0}, RuntimeOptions{0, 1, 1, 0.02}})
    expect_identical_run(run(o), base);
  // A group's own depth (the first block's 3 under a root's 0) is a prefetch like any other.
  set_runtime_options(RuntimeOptions{0, 0, 0});
  expect_identical_run(train(llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) {
                         shard_blocks_and_root(m);
                         set_prefetch_depth(*state_of(*m->blocks[0]), 3);
                       })),
                       base);
  set_runtime_options(defaults);
}

// Small groups (here the nested norm groups, 128 bytes each in float32) go out together: fewer
// collectives, the same numbers. Counted in the last step (the first has no recorded order to
// bucket by). Forward order: root, blocks.0, its attn_norm and mlp_norm, blocks.1, its norms.
//   apart: 7 all-gathers in forward and 6 in backward (the root keeps its parameters);
//   1 kB buckets: blocks.0's prefetch of its attn_norm takes all four norms along, past blocks.1,
//     so forward gathers root, blocks.0, the norms, blocks.1, and backward blocks.1, the norms,
//     blocks.0: 7. Reduce-scatters go out when a block's 30 kB join the bucket (each block with
//     the norms whose gradients came before it) and at the end with the root: 3;
//   and a wait of one group: a second norm joining the bucket sends it, one more: 4.
TEST(Parity, BucketingSmallGroupsIssuesFewerCollectives) {
  const RuntimeOptions defaults = runtime_options();
  auto run = [](double bucket_mb, int max_wait, RuntimeStats* counted) {
    RuntimeOptions o = runtime_options();
    o.bucket_mb = bucket_mb;
    o.reduce_bucket_max_wait = max_wait;
    set_runtime_options(o);
    TrainSetup setup = llama_setup(seeded_llama(tiny_llama()), [](TestLlama& m) {
      for (auto& b : m->blocks) {
        fully_shard(b->attn_norm);
        fully_shard(b->mlp_norm);
        fully_shard(b);
      }
      fully_shard(m);
    });
    RuntimeStats before;
    setup.before_step = [&before, last = setup.steps - 1](int step) {
      if (step == last) before = runtime_stats();
    };
    auto result = train(setup);
    counted->all_gathers = runtime_stats().all_gathers - before.all_gathers;
    counted->reduce_scatters = runtime_stats().reduce_scatters - before.reduce_scatters;
    return result;
  };
  RuntimeStats alone, bucketed, waited;
  auto base = run(0, 0, &alone);
  expect_identical_run(run(1e-3, 0, &bucketed), base);  // 1 kB: the norm groups, not the blocks
  expect_identical_run(run(1e-3, 1, &waited), base);
  EXPECT_EQ(alone.all_gathers, 13);
  EXPECT_EQ(alone.reduce_scatters, 7);
  EXPECT_EQ(bucketed.all_gathers, 7);
  EXPECT_EQ(bucketed.reduce_scatters, 3);
  EXPECT_EQ(waited.all_gathers, 7);
  EXPECT_EQ(waited.reduce_scatters, 4);
  set_runtime_options(defaults);
}

// Where the shards live and how the steps run: offloaded groups step on the root's host worker
// (RuntimeOptions::max_pending_host_steps of them pending; 0: on backward's thread), groups on the
// device on backward's thread. "mixed": blocks offloaded, the root's own parameters not.
struct StepCase {
  const char* name;
  bool offload_blocks, offload_root;
  int pending;
};

// torch's AdamW with one optimizer per parameter, so that any group's parameters step alone.
class PerParameterAdamW {
 public:
  explicit PerParameterAdamW(const std::vector<at::Tensor>& params) : params_(params) {
    for (const auto& p : params)
      by_param_[p.unsafeGetTensorImpl()] = std::make_unique<torch::optim::AdamW>(
          std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  void step(const std::vector<at::Tensor>& params) {
    for (const auto& p : params) by_param_.at(p.unsafeGetTensorImpl())->step();
  }
  void step() { step(params_); }
  void zero_grad() {
    for (const auto& p : params_) p.mutable_grad() = at::Tensor();
  }

 private:
  std::vector<at::Tensor> params_;
  std::map<const void*, std::unique_ptr<torch::optim::AdamW>> by_param_;
};

// The optimizer stepped group by group in backward (set_step_in_backward) computes what one step
// after backward does: AdamW's update of a parameter reads only its gradient and state, and is
// elementwise, so the runs are bit-identical, offloaded or not. After each
// backward no gradient is left (only one group's existed at a time), and clipping is refused. On
// CPU ranks (host memory counted exactly) a backward with the step in it leaves less allocated,
// by exactly the storage of the gradients the other run's backward leaves.
TEST(Parity, StepInBackwardIsTheStepAfterBackward) {
  count_host_allocations();
  const RuntimeOptions defaults = runtime_options();
  for (const StepCase c : {StepCase{"on the device", false, false, 2}, StepCase{"offloaded, no worker", true, true, 0},
                           StepCase{"offloaded, 1 pending", true, true, 1}, StepCase{"offloaded", true, true, 2},
                           StepCase{"mixed", true, false, 2}}) {
    SCOPED_TRACE(c.name);
    RuntimeOptions options = defaults;
    options.max_pending_host_steps = c.pending;
    set_runtime_options(options);
    int64_t held_after_backward[2] = {0, 0};  // [in_backward]: bytes the last backward left allocated
    int64_t gradient_bytes = 0;               // the storage of the gradients then (stepped after backward)
    std::atomic<int> stepping{0};
    std::atomic<bool> overlapped{false};
    std::mutex threads_mutex;
    std::set<std::thread::id> step_threads;
    std::thread::id backward_thread;
    auto run = [&](bool in_backward) {
      TestLlama llama = seeded_llama(tiny_llama());
      ShardOptions blocks, root;
      blocks.cpu_offload = c.offload_blocks;
      root.cpu_offload = c.offload_root;
      for (auto& b : llama->blocks) fully_shard(b, blocks);
      fully_shard(llama, root);
      PerParameterAdamW adam(llama->parameters());
      if (in_backward)
        set_step_in_backward(llama, [&](const std::vector<at::Tensor>& params) {
          if (++stepping > 1) overlapped = true;
          {
            std::lock_guard<std::mutex> lock(threads_mutex);
            step_threads.insert(std::this_thread::get_id());
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));  // a window for a second step to overlap
          adam.step(params);
          --stepping;
        });
      const auto tokens = token_rows(llama->config.vocab, 5, 0, world()->rank() * 2, 2, 16);
      TrainResult result;
      for (int step = 0; step < 4; ++step) {
        adam.zero_grad();
        const int64_t at_start = allocated_bytes(device()).now;
        at::Tensor loss =
            fsdp::forward(llama, tokens.narrow(1, 0, 16).to(device()), tokens.narrow(1, 1, 16).to(device()));
        loss.register_hook([&](const at::Tensor& grad) {  // runs on backward's thread, first
          backward_thread = std::this_thread::get_id();
          return grad;
        });
        loss.backward();
        held_after_backward[in_backward] = allocated_bytes(device()).now - at_start;
        if (!in_backward) {
          std::unordered_set<const void*> storages;
          gradient_bytes = 0;
          for (const auto& p : llama->parameters())
            if (p.grad().defined() && storages.insert(p.grad().storage().data()).second)
              gradient_bytes += static_cast<int64_t>(p.grad().storage().nbytes());
        }
        if (in_backward) {
          for (const auto& p : llama->parameters()) EXPECT_FALSE(p.grad().defined());
          EXPECT_THROW(clip_grad_norm_(*llama, 1.0), std::logic_error);
        } else {
          adam.step();
        }
        result.losses.push_back(loss.item<double>());
      }
      result.params = full_state_dict(*llama);
      return result;
    };
    expect_identical_run(run(true), run(false));
    ASSERT_GT(gradient_bytes, 0);
    if (device().is_cpu()) EXPECT_EQ(held_after_backward[false] - held_after_backward[true], gradient_bytes);
    EXPECT_FALSE(overlapped) << "the step function ran twice at once";
    if (c.offload_root && c.pending > 0) {  // every step on the worker
      EXPECT_EQ(step_threads.size(), 1u);
      EXPECT_EQ(step_threads.count(backward_thread), 0u);
    }
  }
  set_runtime_options(defaults);
}

// The group form that keeps the gradients (a front end's post-accumulate-grad hooks): each
// group's step runs once a synced backward, on backward's thread even for offloaded groups, none
// in a backward without gradient sync; the gradients stay, so clip_grad_norm_ takes them, and the
// runs (AdamW after backward with the clipped gradients) equal those without it bit for bit.
TEST(Parity, AGroupsStepThatKeepsTheGradientsRunsOnceASyncedBackward) {
  auto run = [&](bool with_step) {
    TestLlama llama = seeded_llama(tiny_llama());
    ShardOptions blocks;
    blocks.cpu_offload = true;  // would step on the host worker if the step freed the gradients
    for (auto& b : llama->blocks) fully_shard(b, blocks);
    fully_shard(llama);
    std::map<const GroupState*, int> steps;  // steps this backward, by group
    std::thread::id backward_thread;
    bool off_thread = false;
    std::set<GroupState*> groups;
    for (const auto& p : llama->parameters()) groups.insert(group_of_parameter(p).get());
    if (with_step)
      for (GroupState* group : groups)
        set_step_in_backward(*group, [&, group](const std::vector<at::Tensor>& params) {
          ++steps[group];
          if (std::this_thread::get_id() != backward_thread) off_thread = true;
          for (const auto& p : params) EXPECT_TRUE(p.grad().defined()) << group_name(*group);
        }, /*frees_gradients=*/false);
    PerParameterAdamW adam(llama->parameters());
    const auto tokens = token_rows(llama->config.vocab, 5, 0, world()->rank() * 2, 2, 16);
    TrainResult result;
    for (int step = 0; step < 3; ++step) {
      adam.zero_grad();
      for (bool sync : {false, true}) {  // two micro-batches, the first without gradient sync
        set_requires_gradient_sync(llama, sync);
        steps.clear();
        at::Tensor loss =
            fsdp::forward(llama, tokens.narrow(1, 0, 16).to(device()), tokens.narrow(1, 1, 16).to(device()));
        loss.register_hook([&](const at::Tensor& grad) {
          backward_thread = std::this_thread::get_id();
          return grad;
        });
        loss.backward();
        if (with_step) {
          EXPECT_EQ(steps.size(), sync ? groups.size() : 0u) << "step " << step << ", sync " << sync;
          for (const auto& [group, count] : steps) EXPECT_EQ(count, 1) << group_name(*group);
        }
        if (sync) result.losses.push_back(loss.item<double>());
      }
      result.grad_norms.push_back(clip_grad_norm_(*llama, 0.5).item<double>());
      adam.step();
    }
    EXPECT_FALSE(off_thread) << "a step that keeps the gradients ran off backward's thread";
    result.params = full_state_dict(*llama);
    return result;
  };
  const TrainResult with = run(true), without = run(false);
  expect_identical_run(with, without);
  EXPECT_EQ(with.grad_norms, without.grad_norms);
}

// A step that throws fails the backward, naming the module, whichever thread it ran on.
TEST(Parity, AFailedStepInBackwardNamesTheModule) {
  const RuntimeOptions defaults = runtime_options();
  for (int pending : {0, 2}) {
    RuntimeOptions options = defaults;
    options.max_pending_host_steps = pending;
    set_runtime_options(options);
    TestLlama llama = seeded_llama(tiny_llama());
    ShardOptions offloaded;
    offloaded.cpu_offload = true;
    shard_blocks_and_root(llama, offloaded);
    int calls = 0;
    set_step_in_backward(llama, [&calls](const std::vector<at::Tensor>&) {
      if (++calls == 2) throw std::runtime_error("no room for the moments");
    });
    const auto tokens = token_rows(llama->config.vocab, 5, 0, world()->rank() * 2, 2, 16);
    at::Tensor loss = fsdp::forward(llama, tokens.narrow(1, 0, 16).to(device()), tokens.narrow(1, 1, 16).to(device()));
    try {
      loss.backward();
      ADD_FAILURE() << "backward went through a failed step (pending " << pending << ")";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the optimizer step in backward of '#"), std::string::npos) << what;
      EXPECT_NE(what.find("no room for the moments"), std::string::npos) << what;
    }
  }
  set_runtime_options(defaults);
}

}  // namespace
}  // namespace fsdp::testing
