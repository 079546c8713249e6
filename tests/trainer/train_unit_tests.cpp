// Single-process tests of the trainer's parts: the LR schedule, the token source, the fused AdamW
// against libtorch's, which checkpoints --keep-last removes, the progress lines (--log-every).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <string>
#include <vector>

#include "io/files.h"
#include "train/args.h"
#include "train/data.h"
#include "train/fused_adamw.h"
#include "train/llama_schedule.h"
#include "train/lineage.h"
#include "train/lr_schedule.h"
#include "train/progress_line.h"
#include "train/step_log.h"

namespace {

TEST(LrSchedule, WarmupThenCosineToMin) {
  fsdp::train::LrSchedule s{1.0, 0.1, 4, 14};
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_NEAR(s.at(9), 0.55, 1e-12);  // half way down
  EXPECT_DOUBLE_EQ(s.at(14), 0.1);
  EXPECT_DOUBLE_EQ(s.at(100), 0.1);
}

// Only the run's own checkpoints count and go, oldest first; another run's and unreadable ones stay.
TEST(KeepLast, RemovesTheRunsOwnBeyondItsNewest) {
  using fsdp::train::SavedCheckpoint;
  const std::vector<SavedCheckpoint> saved{{"d/step-000002", 2, "a"}, {"d/step-000004", 4, "b"},
                                           {"d/step-000006", 6, "a"}, {"d/step-000008", 8, ""},
                                           {"d/step-000010", 10, "a"}};
  const auto paths = [](const std::vector<SavedCheckpoint>& cs) {
    std::vector<std::string> p;
    for (const auto& c : cs) p.push_back(c.path);
    return p;
  };
  EXPECT_EQ(paths(fsdp::train::older_than_newest(saved, "a", 1)),
            (std::vector<std::string>{"d/step-000002", "d/step-000006"}));
  EXPECT_EQ(paths(fsdp::train::older_than_newest(saved, "a", 2)), (std::vector<std::string>{"d/step-000002"}));
  EXPECT_TRUE(fsdp::train::older_than_newest(saved, "a", 3).empty());
  EXPECT_TRUE(fsdp::train::older_than_newest(saved, "", 1).empty());  // no run id: nothing is its own
}

TEST(StepLog, PrintsEveryNthStepWithTheTimeLeftAndLogsEveryStep) {
  const std::string path = testing::TempDir() + "step_log_test.jsonl";
  std::remove(path.c_str());
  testing::internal::CaptureStdout();
  {
    fsdp::train::StepLog log(path, {"run-a"}, /*print_every=*/3);
    for (int step = 1; step <= 7; ++step) {
      fsdp::train::StepRecord r;
      r.step = step, r.steps = 7, r.ms = step == 1 ? 5000 : 100, r.tokens_per_step = 1000;
      log.write(r);
    }
  }
  const std::string printed = testing::internal::GetCapturedStdout();
  std::vector<std::string> lines;
  for (size_t at = 0, end; (end = printed.find('\n', at)) != std::string::npos; at = end + 1)
    lines.push_back(printed.substr(at, end - at));
  ASSERT_EQ(lines.size(), 4u) << printed;  // the first, the multiples of 3, the last
  EXPECT_EQ(lines[0].rfind("step    1/7", 0), 0u);
  EXPECT_NE(lines[0].find("eta 30s"), std::string::npos) << lines[0];  // 6 steps at the first's 5 s
  EXPECT_EQ(lines[1].rfind("step    3/7", 0), 0u);
  EXPECT_NE(lines[1].find("eta 0s"), std::string::npos) << lines[1];  // the first step left out: 0.4 s
  EXPECT_EQ(lines[3].rfind("step    7/7", 0), 0u);
  EXPECT_EQ(lines[3].find("eta"), std::string::npos) << lines[3];
  std::ifstream in(path);
  int logged = 0;
  for (std::string line; std::getline(in, line);) ++logged;
  EXPECT_EQ(logged, 7);
  EXPECT_EQ(fsdp::train::eta_text(1000, 45), "45s");
  EXPECT_EQ(fsdp::train::eta_text(1000, 192), "3m12s");
  EXPECT_EQ(fsdp::train::eta_text(1000, 7500), "2h05m");
}

// A log is never emptied: another run is refused, a resumed run of the log's lineage appends after
// its run mark, --overwrite-log alone replaces it.
TEST(StepLog, AnExistingLogIsAppendedToByItsOwnRunAloneAndNeverEmptied) {
  const std::string path = testing::TempDir() + "step_log_owner_test.jsonl";
  std::remove(path.c_str());
  const auto write_steps = [&](const fsdp::train::LogOwner& owner, int first, int last) {
    fsdp::train::StepLog log(path, owner);
    testing::internal::CaptureStdout();
    for (int step = first; step <= last; ++step) {
      fsdp::train::StepRecord r;
      r.step = step, r.steps = 8, r.ms = 1, r.tokens_per_step = 1;
      log.write(r);
    }
    testing::internal::GetCapturedStdout();
  };
  const auto lines = [&] {
    std::vector<std::string> out;
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };
  const auto has = [](const std::string& line, const std::string& field) {
    return line.find(field) != std::string::npos;
  };
  write_steps({"run-a"}, 1, 4);
  EXPECT_THROW(write_steps({"run-b"}, 1, 2), fsdp::train::UsageError);                 // another run
  EXPECT_THROW(write_steps({"run-a"}, 1, 2), fsdp::train::UsageError);                 // the same, not resumed
  EXPECT_THROW(write_steps({"run-b", 4}, 5, 6), fsdp::train::UsageError);              // another lineage resumed
  ASSERT_EQ(lines().size(), 4u);
  write_steps({"run-a", 3}, 4, 8);  // resumed from its step-3 checkpoint
  auto logged = lines();
  ASSERT_EQ(logged.size(), 9u);
  EXPECT_TRUE(has(logged[0], R"("run":"run-a")")) << logged[0];
  EXPECT_FALSE(has(logged[0], "resumed_from"));
  EXPECT_TRUE(has(logged[4], R"({"step":4,)")) << logged[4];
  EXPECT_TRUE(has(logged[4], R"("run":"run-a","resumed_from":3)")) << logged[4];
  EXPECT_FALSE(has(logged[5], R"("run")"));
  write_steps({"run-c", std::nullopt, /*overwrite=*/true}, 1, 2);
  logged = lines();
  ASSERT_EQ(logged.size(), 2u);
  EXPECT_TRUE(has(logged[0], R"("run":"run-c")")) << logged[0];
}

// A schedule that is not the Llama's groups (the root and each block), or recomputes the root, is
// refused before anything is sharded.
TEST(LlamaSchedule, ScheduleOfOtherGroupsOrARecomputedRootIsRefused) {
  fsdp::model::LlamaConfig config;
  fsdp::model::Llama llama(config);
  fsdp::plan::Schedule root_recomputed = fsdp::plan::default_schedule(llama->blocks.size() + 1);
  root_recomputed.recompute[0] = true;
  EXPECT_THROW(fsdp::train::shard_with_schedule(llama, root_recomputed, {}), std::invalid_argument);
  EXPECT_THROW(fsdp::train::shard_with_schedule(llama, fsdp::plan::default_schedule(1), {}), std::invalid_argument);
}

TEST(TokenSource, GlobalBatchDoesNotDependOnHowItIsSplit) {
  auto data = fsdp::train::synthetic_tokens(50, 16, 7);
  auto whole = data->samples(30, 6);
  auto split = torch::cat({data->samples(30, 2), data->samples(32, 2), data->samples(34, 2)});
  EXPECT_TRUE(torch::equal(whole, split));
  EXPECT_FALSE(torch::equal(whole, data->samples(36, 6)));
  EXPECT_EQ(whole.size(1), 17);
  EXPECT_LT(whole.max().item<int64_t>(), 50);
  EXPECT_GE(whole.min().item<int64_t>(), 0);
}

// A bijection of [0, n) for sizes around powers of four (where cycle walking starts), another
// order for another key, and not the identity.
TEST(Shuffle, IsAPermutationChosenByItsKey) {
  for (uint64_t n : {1, 2, 3, 4, 5, 16, 17, 1000, 4099}) {
    const fsdp::train::Shuffle a(n, 11), b(n, 12);
    std::vector<int> seen(n, 0);
    bool same_as_b = true, identity = true;
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t j = a(i);
      ASSERT_LT(j, n) << "n " << n;
      ++seen[j];
      same_as_b = same_as_b && j == b(i);
      identity = identity && j == i;
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<long>(n)) << "n " << n;
    if (n >= 16) EXPECT_FALSE(same_as_b || identity) << "n " << n;
  }
}

namespace {

// An llm.c uint16 token file of `ids`.
void write_token_file(const std::string& path, const std::vector<uint16_t>& ids) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520, header[1] = 1, header[2] = static_cast<int32_t>(ids.size());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  out.write(reinterpret_cast<const char*>(ids.data()), ids.size() * 2);
}

std::vector<uint16_t> counting(uint16_t from, int count) {
  std::vector<uint16_t> ids(count);
  for (int i = 0; i < count; ++i) ids[i] = static_cast<uint16_t>(from + i);
  return ids;
}

}  // namespace

// A directory of two files at --seq 8: 41 tokens hold 5 windows (from tokens 0, 8, ..., 32; each
// window's last token the next one's first), 21 tokens 2. In order: the windows in file order,
// again from the start after the last. Shuffled: each epoch of 7 samples visits every window
// once, the epochs in different orders, whatever pieces the samples are read in.
TEST(TokenSource, FilesAreReadWindowByWindowEachEpochInAnOrderOfItsOwn) {
  const std::string dir = ::testing::TempDir() + "/token-corpus";
  fsdp::io::remove_tree(dir);  // std::filesystem: libtorch's copy of it is built for another ABI
  fsdp::io::make_directories(dir);
  write_token_file(dir + "/000000.bin", counting(0, 41));
  write_token_file(dir + "/000001.bin", counting(100, 21));
  const auto files = fsdp::train::data_files(dir);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], dir + "/000000.bin");
  const std::vector<int64_t> windows = {0, 8, 16, 24, 32, 100, 108};  // each window's first token

  auto in_order = fsdp::train::file_tokens(files, 8, 5, fsdp::train::SampleOrder::InOrder);
  EXPECT_EQ(in_order->epoch_samples(), 7);
  const auto read = in_order->samples(0, 8);
  ASSERT_EQ(read.sizes(), (std::vector<int64_t>{8, 9}));
  for (int64_t r = 0; r < 8; ++r)
    EXPECT_TRUE(torch::equal(read[r], torch::arange(windows[r % 7], windows[r % 7] + 9))) << "sample " << r;

  auto shuffled = fsdp::train::file_tokens(files, 8, 5, fsdp::train::SampleOrder::Shuffled);
  const auto two_epochs = shuffled->samples(0, 14);
  EXPECT_TRUE(torch::equal(two_epochs, torch::cat({shuffled->samples(0, 3), shuffled->samples(3, 9),
                                                   shuffled->samples(12, 2)})));
  std::vector<int64_t> orders[2];
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (int64_t r = 0; r < 7; ++r) {
      const auto row = two_epochs[epoch * 7 + r];
      const int64_t first = row[0].item<int64_t>();
      EXPECT_TRUE(torch::equal(row, torch::arange(first, first + 9))) << "a window is 9 consecutive ids";
      orders[epoch].push_back(first);
    }
    auto sorted = orders[epoch];
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, windows) << "epoch " << epoch;
  }
  EXPECT_NE(orders[0], orders[1]);
  EXPECT_NE(orders[0], windows);
  auto other_seed = fsdp::train::file_tokens(files, 8, 6, fsdp::train::SampleOrder::Shuffled);
  EXPECT_FALSE(torch::equal(other_seed->samples(0, 7), two_epochs.narrow(0, 0, 7)));

  fsdp::io::make_directories(dir + "/empty");
  EXPECT_THROW(fsdp::train::data_files(dir + "/empty"), std::invalid_argument);
  EXPECT_THROW(fsdp::train::file_tokens(files, 64, 5, fsdp::train::SampleOrder::InOrder), std::invalid_argument);
}

// The fused kernel must be libtorch's AdamW, update for update, including a
// parameter that gets no gradient in some steps (its step count stays behind).
TEST(FusedAdamW, MatchesLibtorchAdamW) {
  torch::manual_seed(3);
  const std::vector<at::Tensor> init = {torch::randn({5, 3}), torch::randn({7}), torch::randn({2, 2})};
  auto copies = [&] {
    std::vector<at::Tensor> out;
    for (const auto& t : init) out.push_back(t.clone().requires_grad_(true));
    return out;
  };
  auto fused_params = copies(), plain_params = copies();
  const auto options = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1);
  fsdp::train::FusedAdamW fused(fused_params, options);
  torch::optim::AdamW plain(plain_params, options);
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < init.size(); ++i) {
      const bool skipped = i == 1 && step % 2 == 1;
      auto grad = torch::randn_like(init[i]);
      for (auto* params : {&fused_params, &plain_params}) {
        auto& p = (*params)[i];
        p.mutable_grad() = skipped ? at::Tensor() : grad.clone();
      }
    }
    fused.step();
    plain.step();
  }
  for (size_t i = 0; i < init.size(); ++i) {
    EXPECT_FALSE(torch::allclose(fused_params[i], init[i])) << i;
    EXPECT_TRUE(torch::allclose(fused_params[i], plain_params[i], 1e-6, 1e-6))
        << i << ": " << (fused_params[i] - plain_params[i]).abs().max().item<double>();
  }
}

// A step with a gradient divisor is the step after dividing the gradients (the clip in the update).
TEST(FusedAdamW, GradDivisorIsTheGradientsDividedFirst) {
  torch::manual_seed(5);
  const auto init = torch::randn({9, 4});
  auto divided = init.clone().requires_grad_(true), plain = init.clone().requires_grad_(true);
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fsdp::train::FusedAdamW with_divisor({divided}, options), after_dividing({plain}, options);
  for (int step = 0; step < 3; ++step) {
    const auto grad = torch::randn({9, 4});
    const double by = step == 1 ? 1.0 : 4.0 + step;
    divided.mutable_grad() = grad.clone();
    plain.mutable_grad() = grad / by;
    with_divisor.step_with_grad_divisor(step == 1 ? at::Tensor() : torch::full({}, by));
    after_dividing.step();
  }
  EXPECT_FALSE(torch::allclose(divided, init));
  EXPECT_TRUE(torch::allclose(divided, plain, 1e-6, 1e-7)) << (divided - plain).abs().max().item<double>();
  EXPECT_THROW(with_divisor.step_with_grad_divisor(torch::ones({2})), std::invalid_argument);
}

// init_state() allocates the moments up front in the parameters' current
// (sharded) shapes, only for trainable parameters, and changes no update.
TEST(FusedAdamW, InitStateUpFrontInCurrentShapes) {
  torch::manual_seed(4);
  auto trained = torch::randn({6, 4}).requires_grad_(true);
  auto frozen = torch::randn({3});
  auto reference = trained.detach().clone().requires_grad_(true);
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fsdp::train::FusedAdamW eager({trained, frozen}, options), lazy({reference}, options);
  // What sharding does to a parameter the optimizer already holds: new, smaller data.
  {
    at::NoGradGuard no_grad;
    trained.set_data(trained.detach()[0].clone());
    reference.set_data(reference.detach()[0].clone());
  }
  eager.init_state();
  ASSERT_EQ(eager.state().size(), 1u);  // none for the frozen parameter
  const auto& moments = static_cast<const fsdp::train::FusedAdamWState&>(
      *eager.state().at(trained.unsafeGetTensorImpl()));
  EXPECT_EQ(moments.exp_avg.sizes(), trained.sizes());
  EXPECT_EQ(moments.exp_avg_sq.sizes(), trained.sizes());
  for (int step = 0; step < 3; ++step) {
    auto grad = torch::randn({4});
    trained.mutable_grad() = grad.clone();
    reference.mutable_grad() = grad.clone();
    eager.step();
    lazy.step();
  }
  EXPECT_TRUE(torch::equal(trained, reference));
}

// State created before sharding no longer fits the parameter: a clear error, not
// a shape failure inside the fused kernel.
TEST(FusedAdamW, StateOlderThanShardingIsRefused) {
  auto param = torch::randn({6, 4}).requires_grad_(true);
  fsdp::train::FusedAdamW optimizer({param}, torch::optim::AdamWOptions(1e-2));
  optimizer.init_state();
  {
    at::NoGradGuard no_grad;
    param.set_data(param.detach()[0].clone());
  }
  param.mutable_grad() = torch::ones({4});
  try {
    optimizer.step();
    FAIL() << "step() accepted moments of the parameter's old shape";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("create the state after sharding"), std::string::npos) << e.what();
  }
}

// A progress line is drawn on a terminal (here fsdp-run's word for one) by the lead rank alone,
// at most twice a second (a fast save draws none), and erased by end(); moved() gives the bytes
// last told and their rate.
TEST(ProgressLine, DrawsOnATerminalAtMostTwiceASecondAndErasesItself) {
  ::setenv("FSDP_STDOUT_IS_TERMINAL", "1", 1);
  const auto printed = [](bool lead, bool wait) {
    ::testing::internal::CaptureStdout();
    {
      fsdp::train::ProgressLine line("saving ck/step-000020", lead);
      line.callback()(1000, 4000000000);  // at once: not drawn
      if (wait) std::this_thread::sleep_for(std::chrono::milliseconds(600));
      line.callback()(1000000000, 4000000000);
      line.end();
      line.update(2000000000, 4000000000);  // after end(): nothing
      EXPECT_NE(line.moved().find("2.00 GB at "), std::string::npos) << line.moved();
    }
    return ::testing::internal::GetCapturedStdout();
  };
  EXPECT_EQ(printed(true, false), "");
  EXPECT_EQ(printed(false, true), "");
  const std::string drawn = printed(true, true);
  ::unsetenv("FSDP_STDOUT_IS_TERMINAL");
  EXPECT_EQ(drawn.rfind("\r\033[Kfsdp-train: saving ck/step-000020: 25% of 4.00 GB, ", 0), 0u) << drawn;
  EXPECT_NE(drawn.find(" left\r\033[K"), std::string::npos) << drawn;  // erased at the end
  EXPECT_EQ(drawn.find('\n'), std::string::npos) << drawn;
}

}  // namespace
