// Several sharded roots in one process: each root keeps its own step, execution order
// and in-flight queues, so a frozen teacher's forward between a student's forward and backward,
// two models stepping alternately or one inside the other's step, an EMA copy, and roots on
// different communicators each train exactly as their single-process references do.
#include "helpers.h"
#include "fsdp/memory_stats.h"

namespace fsdp::testing {
namespace {

// Another shape than tiny_llama's (three blocks: its own execution order), the same vocabulary.
TestLlamaConfig three_block_llama() {
  TestLlamaConfig c = tiny_llama();
  c.n_layers = 3;
  c.ffn = 40;
  return c;
}

TestLlama frozen_teacher() {
  TestLlama teacher = seeded_llama(three_block_llama(), 7);
  for (auto& p : teacher->parameters()) p.requires_grad_(false);
  return teacher;
}

// The distillation step: the student's loss on the next tokens plus its logits' squared distance
// to a frozen teacher's, the teacher run forward-only between the student's forward and backward.
TrainSetup distillation_setup(TestLlama student, TestLlama teacher, bool sharded) {
  TrainSetup s = llama_setup(student);
  s.loss = [student, teacher](int64_t, int64_t first, int64_t count) mutable {
    auto tokens = token_rows(student->config.vocab, 99, 0, first, count, kLlamaSeq).to(device());
    auto inputs = tokens.narrow(1, 0, kLlamaSeq);
    auto logits = fsdp::forward(student, inputs).to(torch::kFloat);
    at::Tensor target;
    {
      torch::NoGradGuard forward_only;
      target = fsdp::forward(teacher, inputs).to(torch::kFloat);
    }
    const auto vocab = student->config.vocab;
    return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}),
                                                tokens.narrow(1, 1, kLlamaSeq).reshape({-1})) +
           torch::nn::functional::mse_loss(logits, target);
  };
  if (sharded)
    s.shard = [student, teacher]() mutable {
      shard_blocks_and_root(student);
      shard_blocks_and_root(teacher);
    };
  // The student's chain (llama_setup's), then the teacher's forward and the distance.
  s.chain_depth += 9 * static_cast<int>(teacher->config.n_layers) + 4 + 1;
  return s;
}

TEST(Roots, DistillationWithAFrozenTeacherMatchesSingleProcess) {
  const TrainResult want = train(distillation_setup(seeded_llama(tiny_llama()), frozen_teacher(), false));
  TestLlama teacher = frozen_teacher();
  expect_same_run(train(distillation_setup(seeded_llama(tiny_llama()), teacher, true)), want);
  // Forward-only, the teacher kept its weights exactly.
  TestLlama fresh = frozen_teacher();
  const auto kept = full_state_dict(*teacher);
  const auto initial = fresh->named_parameters();
  for (const auto& [name, value] : kept)
    if (initial.contains(name)) EXPECT_TRUE(torch::equal(value, initial[name])) << name;
}

TEST(Roots, TwoRootsSteppingAlternatelyEachMatchTheirReference) {
  auto setup = [](TestLlama m, bool sharded) {
    return llama_setup(m, sharded ? std::function<void(TestLlama&)>(
                                        [](TestLlama& l) { shard_blocks_and_root(l); })
                                  : nullptr);
  };
  const TrainResult want_a = train(setup(seeded_llama(tiny_llama()), false));
  const TrainResult want_b = train(setup(seeded_llama(three_block_llama(), 6), false));
  Trainer a(setup(seeded_llama(tiny_llama()), true)), b(setup(seeded_llama(three_block_llama(), 6), true));
  for (int i = 0; i < 2; ++i) {  // one after the other
    a.step();
    b.step();
  }
  for (int i = 0; i < 2; ++i) a.step([&] { b.step(); });  // B's whole step between A's forward and backward
  expect_same_run(a.result(), want_a);
  expect_same_run(b.result(), want_b);
}

// The world split in two halves: A is sharded over this rank's half (each half its own model),
// B over the world; B's steps run inside A's.
TEST(Roots, RootsOnDifferentCommunicatorsTrainTogether) {
  const int color = world()->rank() < (world()->world_size() + 1) / 2 ? 0 : 1;
  std::shared_ptr<Communicator> half = world()->split(color, world()->rank(), "half " + std::to_string(color));
  auto setup_a = [&](bool sharded) {
    TrainSetup s = llama_setup(seeded_llama(tiny_llama(), 10 + color));
    if (sharded)
      s.shard = [m = std::static_pointer_cast<TestLlamaImpl>(s.module), half]() mutable {
        TestLlama llama(m);
        ShardOptions on_half;
        on_half.comm = half;
        shard_blocks_and_root(llama, on_half);
      };
    s.comm = half;
    return s;
  };
  auto setup_b = [](bool sharded) {
    return llama_setup(seeded_llama(three_block_llama(), 6),
                       sharded ? std::function<void(TestLlama&)>([](TestLlama& l) { shard_blocks_and_root(l); })
                               : nullptr);
  };
  const TrainResult want_a = train(setup_a(false)), want_b = train(setup_b(false));
  Trainer a(setup_a(true)), b(setup_b(true));
  for (int i = 0; i < 4; ++i) a.step([&] { b.step(); });
  expect_same_run(a.result(), want_a);
  expect_same_run(b.result(), want_b);
}

// The EMA copy: updated shard by shard after every step (no collective: the ranks call it
// different numbers of times on a scratch copy), it equals the single-process EMA.
TEST(Roots, EmaKeptAsShardsMatchesSingleProcess) {
  constexpr double kDecay = 0.8;
  auto run = [&](bool sharded) {
    TestLlama student = seeded_llama(tiny_llama()), ema = seeded_llama(tiny_llama());
    TrainSetup s = llama_setup(student);
    if (sharded)
      s.shard = [student, ema]() mutable {
        shard_blocks_and_root(student);
        shard_blocks_and_root(ema);
      };
    Trainer trainer(s);
    for (int step = 0; step < 4; ++step) {
      trainer.step();
      if (sharded) {
        ema_update_(*ema, *student, kDecay);
      } else {
        torch::NoGradGuard no_grad;
        for (auto& [name, p] : ema->named_parameters().pairs())
          p.mul_(kDecay).add_(student->named_parameters()[name], 1 - kDecay);
      }
    }
    TrainResult result = trainer.result();
    result.params = Trainer::full_values(*ema, sharded);
    return result;
  };
  const TrainResult want = run(false), got = run(true);
  // The EMA is a weighted mean of the student's weights over the steps: within the same bound.
  EXPECT_THAT(run_differences(got, want), ::testing::IsEmpty());

  TestLlama student = seeded_llama(tiny_llama()), scratch = seeded_llama(tiny_llama(), 9);
  shard_blocks_and_root(student);
  shard_blocks_and_root(scratch);
  const auto before = scratch->named_parameters().values()[0].clone();
  for (int i = 0; i < world()->rank(); ++i) ema_update_(*scratch, *student, 0.5);
  auto expected = before;
  for (int i = 0; i < world()->rank(); ++i) expected = expected * 0.5 + student->named_parameters().values()[0] * 0.5;
  EXPECT_TRUE(torch::equal(scratch->named_parameters().values()[0], expected));
}

TEST(Roots, EmaOfAnotherLayoutIsAnError) {
  TestLlama student = seeded_llama(tiny_llama()), unsharded = seeded_llama(tiny_llama());
  shard_blocks_and_root(student);
  try {
    ema_update_(*unsharded, *student, 0.9);
    if (world()->world_size() > 1) ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("shard the EMA copy as the model"));
  }
  EXPECT_THROW(ema_update_(*student, *student, 1.5), std::invalid_argument);
}

// Forward-only (evaluation, a teacher): all-gathers and frees as in training, arms no backward,
// and leaves memory where it was: the sharded baseline.
TEST(Roots, ForwardOnlyReturnsToTheShardedBaseline) {
  count_host_allocations();
  TestLlama llama = seeded_llama(tiny_llama());
  shard_blocks_and_root(llama);
  const auto tokens = token_rows(llama->config.vocab, 3, 0, 0, 2, kLlamaSeq).to(device());
  const auto inputs = tokens.narrow(1, 0, kLlamaSeq);
  fsdp::forward(llama, inputs).sum().backward();  // a training step first: records orders, makes gradients
  for (auto& p : llama->parameters()) p.mutable_grad() = at::Tensor();
  const int64_t baseline = allocated_bytes(device()).now;
  const RuntimeStats stats_before = runtime_stats();
  reset_peak_allocated(device());
  {
    torch::NoGradGuard forward_only;
    const at::Tensor logits = fsdp::forward(llama, inputs);
    EXPECT_FALSE(logits.requires_grad());
  }
  EXPECT_EQ(allocated_bytes(device()).now, baseline);
  EXPECT_GT(allocated_bytes(device()).peak, baseline);
  EXPECT_EQ(runtime_stats().all_gathers - stats_before.all_gathers, 3);  // root and two blocks, once each
  EXPECT_EQ(runtime_stats().reduce_scatters, stats_before.reduce_scatters);
}

// One sharded module inside two roots: the second root's first forward names it.
// Scheduling options set on one root apply to that root alone: with its prefetch depth 0 it issues
// no prefetch while a root beside it, on the process-wide default (depth 1), does.
TEST(Roots, RuntimeOptionsOfOneRootLeaveTheOthersOnTheDefault) {
  ASSERT_EQ(runtime_options().prefetch_depth, 1);
  auto own = seeded_llama(tiny_llama()), beside = seeded_llama(tiny_llama());
  shard_blocks_and_root(own);
  shard_blocks_and_root(beside);
  RuntimeOptions no_prefetch = runtime_options();
  no_prefetch.prefetch_depth = 0;
  set_runtime_options(own, no_prefetch);
  auto prefetches_of_a_step = [&](TestLlama& m) {
    const long before = runtime_stats().prefetches;
    next_token_backward(m);
    return runtime_stats().prefetches - before;
  };
  next_token_backward(own);  // the first steps record the orders prefetching follows
  next_token_backward(beside);
  EXPECT_EQ(prefetches_of_a_step(own), 0);
  EXPECT_GT(prefetches_of_a_step(beside), 0);
  EXPECT_EQ(runtime_options().prefetch_depth, 1);  // the default is untouched
  try {
    torch::nn::Linear unsharded(2, 2);
    set_runtime_options(unsharded, no_prefetch);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("the module is not sharded; call fully_shard on it first"));
  }
}

// A group's own prefetch depth overrides its root's: under a root that prefetches nothing, the
// first block's start gathers the two blocks after it in forward (and nothing in backward, where
// it runs last of the blocks and the root already ran), until -1 gives it the root's depth back.
TEST(Roots, AGroupsOwnPrefetchDepthOverridesItsRoots) {
  auto config = tiny_llama();
  config.n_layers = 4;
  auto llama = seeded_llama(config);
  shard_blocks_and_root(llama);
  RuntimeOptions no_prefetch = runtime_options();
  no_prefetch.prefetch_depth = 0;
  set_runtime_options(llama, no_prefetch);
  auto prefetches_of_a_step = [&] {
    const long before = runtime_stats().prefetches;
    next_token_backward(llama);
    return runtime_stats().prefetches - before;
  };
  next_token_backward(llama);  // the first step records the orders prefetching follows
  GroupState& first = *state_of(*llama->blocks[0]);
  set_prefetch_depth(first, 2);
  EXPECT_EQ(prefetch_depth(first), 2);
  EXPECT_EQ(prefetches_of_a_step(), 2);
  set_prefetch_depth(first, -1);
  EXPECT_EQ(prefetches_of_a_step(), 0);
  try {
    set_prefetch_depth(first, -2);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("it must be 0 or more, or -1 for its root's prefetch_depth"));
  }
}

TEST(Roots, AModuleUnderTwoRootsIsAnError) {
  struct Pair : torch::nn::Module {
    explicit Pair(torch::nn::Linear shared) : shared(register_module("shared", shared)) {
      own = register_module("own", torch::nn::Linear(4, 4));
    }
    at::Tensor forward(const at::Tensor& x) { return fsdp::forward(own, fsdp::forward(shared, x)); }
    torch::nn::Linear shared, own{nullptr};
  };
  torch::nn::Linear shared(4, 4);
  auto first = std::make_shared<Pair>(shared), second = std::make_shared<Pair>(shared);
  first->to(device());
  second->to(device());
  fully_shard(shared);
  fully_shard(*first);
  fully_shard(*second);
  const auto x = torch::ones({2, 4}, on_device());
  fsdp::forward(first, x).sum().backward();
  try {
    fsdp::forward(second, x);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("the sharded module 'torch::nn::LinearImpl' already runs under another root"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("a sharded module belongs to one root"));
  }
}

}  // namespace
}  // namespace fsdp::testing
