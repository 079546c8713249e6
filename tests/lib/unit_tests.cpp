// Single-process tests of the library's arithmetic: shard layout, execution order, caps, launch
// variables, recomputation, the runtime knobs (the trainer's own: tests/trainer/train_unit_tests.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <regex>
#include <thread>

#include "fsdp/communicator.h"
#include "fsdp/recompute.h"
#include "fsdp/fully_shard.h"
#include "fsdp/group.h"
#include "fsdp/launch.h"
#include "fsdp/version.h"
#include "fully_shard/param_init.h"
#include "sched/execution_order.h"
#include "sched/host_worker.h"
#include "sched/inflight_queue.h"
#include "shard/flat_copy.h"
#include "shard/shard_layout.h"

namespace {

using fsdp::ShardLayout;

TEST(ShardLayout, UnevenRowsArePaddedOnTheLastRanks) {
  ShardLayout l{10, 4, 3};  // 10 rows on 3 ranks: 4 + 4 + 2, padded to 12
  EXPECT_EQ(l.shard_rows(), 4);
  EXPECT_EQ(l.padded_rows(), 12);
  EXPECT_EQ(l.shard_numel(), 16);
  EXPECT_EQ(l.local_rows(0), 4);
  EXPECT_EQ(l.local_rows(1), 4);
  EXPECT_EQ(l.local_rows(2), 2);
  EXPECT_EQ(l.first_row(2), 8);
}

TEST(ShardLayout, FewerRowsThanRanksLeavesSomeRanksEmpty) {
  ShardLayout l{2, 5, 4};
  EXPECT_EQ(l.shard_rows(), 1);
  EXPECT_EQ(l.local_rows(0), 1);
  EXPECT_EQ(l.local_rows(1), 1);
  EXPECT_EQ(l.local_rows(2), 0);
  EXPECT_EQ(l.local_rows(3), 0);
}

TEST(ShardLayout, EveryRowIsOwnedExactlyOnce) {
  for (int64_t rows : {0, 1, 5, 7, 64, 1001})
    for (int world : {1, 2, 3, 8}) {
      ShardLayout l{rows, 3, world};
      int64_t total = 0;
      for (int r = 0; r < world; ++r) {
        if (l.local_rows(r) > 0) EXPECT_EQ(l.first_row(r), total);
        total += l.local_rows(r);
      }
      EXPECT_EQ(total, rows) << rows << " rows on " << world;
    }
}

// Each piece in a slot of world * ceil(rows / world) rows (ShardLayout::padded_rows): its rows,
// then zeros, so that rank r's rows of every piece are one reduce-scatter's chunk r.
TEST(ParameterMajor, UnevenRowsArePaddedWithZerosAtTheEnd) {
  auto out = torch::empty({12});
  fsdp::parameter_major_into(fsdp::slots_of(out, {fsdp::ShardLayout::of_shape(std::vector<int64_t>{5, 2}, 3)}),
                             {torch::arange(10, torch::kFloat).view({5, 2})});  // shard_rows 2
  EXPECT_TRUE(torch::equal(out, torch::tensor({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0}, torch::kFloat)));
}

TEST(ParameterMajor, SeveralPiecesWholeRanksOfPaddingZeroDimMissingAndCast) {
  const int world = 4;
  const std::vector<std::vector<int64_t>> shapes = {{1, 3}, {}, {4, 1}, {2}};
  std::vector<fsdp::ShardLayout> layouts;
  for (const auto& shape : shapes) layouts.push_back(fsdp::ShardLayout::of_shape(shape, world));
  auto out = torch::full({4 * 3 + 4 + 4 + 4}, -1.0, torch::kFloat);
  fsdp::parameter_major_into(fsdp::slots_of(out, layouts),
                             {torch::ones({1, 3}, torch::kBFloat16), torch::tensor(2.0).to(torch::kBFloat16),
                              torch::full({4, 1}, 7.0, torch::kBFloat16), torch::Tensor()});
  auto expected = torch::zeros({24});
  expected.narrow(0, 0, 3).fill_(1.0);    // the 1-row tensor: rank 0's row, three padding rows
  expected[12] = 2.0;                     // the 0-dim one: one row
  expected.narrow(0, 16, 4).fill_(7.0);   // one row per rank
  EXPECT_TRUE(torch::equal(out, expected)) << out;  // the missing piece: zeros
}

// Slots in buffers of their own (the reduce-scatter's input across ranks) hold what the same
// slots of one flat buffer do.
TEST(ParameterMajor, SlotsOfTheirOwnHoldWhatOneBufferHolds) {
  const std::vector<fsdp::ShardLayout> layouts = {fsdp::ShardLayout::of_shape(std::vector<int64_t>{5, 2}, 2),
                                                  fsdp::ShardLayout::of_shape(std::vector<int64_t>{3}, 2)};
  const std::vector<at::Tensor> pieces = {torch::arange(10, torch::kFloat).view({5, 2}), torch::full({3}, 4.0)};
  auto flat = torch::full({12 + 4}, -1.0);
  fsdp::parameter_major_into(fsdp::slots_of(flat, layouts), pieces);
  std::vector<at::Tensor> own = {torch::full({12}, -1.0), torch::full({4}, -1.0)};
  fsdp::parameter_major_into(own, pieces);
  EXPECT_TRUE(torch::equal(torch::cat(own), flat)) << torch::cat(own) << flat;
  EXPECT_TRUE(torch::equal(own[1], torch::tensor({4.0, 4.0, 4.0, 0.0}, torch::kFloat)));
}

TEST(ExecutionOrder, NoPrefetchBeforeAnOrderIsRecorded) {
  fsdp::ExecutionOrder order;
  order.begin_pass();
  EXPECT_TRUE(order.observe(3));
  EXPECT_TRUE(order.next(3, 1).empty());
}

TEST(ExecutionOrder, PrefetchFollowsTheRecordedOrderToTheRequestedDepth) {
  fsdp::ExecutionOrder order;
  order.begin_pass();
  for (int g : {0, 1, 2, 3}) order.observe(g);
  order.observe(1);  // a group running twice counts at its first appearance
  order.end_pass();
  order.begin_pass();
  EXPECT_TRUE(order.observe(0));
  EXPECT_EQ(order.next(0, 1), (std::vector<int>{1}));
  EXPECT_EQ(order.next(0, 2), (std::vector<int>{1, 2}));
  EXPECT_EQ(order.next(2, 5), (std::vector<int>{3}));
  EXPECT_TRUE(order.next(3, 1).empty());
  EXPECT_TRUE(order.next(0, 0).empty());
  EXPECT_TRUE(order.next(9, 1).empty());  // not in the record
}

TEST(ExecutionOrder, ADepartureStopsPrefetchAndIsRecordedForTheNextPass) {
  fsdp::ExecutionOrder order;
  order.begin_pass();
  for (int g : {0, 1, 2}) order.observe(g);
  order.end_pass();
  order.begin_pass();
  EXPECT_TRUE(order.observe(0));
  EXPECT_FALSE(order.observe(2));  // 1 expected
  EXPECT_EQ(order.departures(), 1);
  EXPECT_TRUE(order.next(2, 1).empty());  // no guessing for the rest of the pass
  EXPECT_FALSE(order.observe(1));
  order.end_pass();
  EXPECT_EQ(order.recorded(), (std::vector<int>{0, 2, 1}));
  order.begin_pass();
  EXPECT_TRUE(order.observe(0));
  EXPECT_EQ(order.next(0, 1), (std::vector<int>{2}));
  EXPECT_EQ(order.departures(), 1);
}

// A stand-in for device work: done when the fake clock passes `finishes_at`.
struct FakeWork {
  int finishes_at;
  int* clock;
  std::vector<int>* waited;
  bool done() const { return *clock >= finishes_at; }
  void wait() const {
    waited->push_back(finishes_at);
    *clock = std::max(*clock, finishes_at);
  }
};

TEST(InflightQueue, BlocksOnTheOldestOnlyWhenAtTheCap) {
  int clock = 0;
  std::vector<int> waited;
  fsdp::InflightQueue<FakeWork> queue(2);
  EXPECT_EQ(queue.make_room(), 0);
  queue.push({10, &clock, &waited});
  EXPECT_EQ(queue.make_room(), 0);
  queue.push({20, &clock, &waited});
  EXPECT_EQ(queue.make_room(), 1);  // two in flight: wait for the one finishing at 10
  EXPECT_EQ(waited, (std::vector<int>{10}));
  EXPECT_EQ(queue.size(), 1u);
  queue.push({30, &clock, &waited});
  clock = 25;  // the device moved on: the finished item is dropped without waiting
  EXPECT_EQ(queue.make_room(), 0);
  EXPECT_EQ(queue.size(), 1u);
}

// The reduce-scatter cap's form: past the cap the oldest is settled (the runtime orders the compute
// stream after it) and dropped, and the CPU never waits.
TEST(InflightQueue, SettlesTheOldestInsteadOfBlockingWhenAsked) {
  int clock = 0;
  std::vector<int> waited, settled;
  fsdp::InflightQueue<FakeWork> queue(2);
  const auto settle = [&](const FakeWork& work) { settled.push_back(work.finishes_at); };
  int settled_count = 0;
  for (int finishes_at : {10, 20, 30}) {
    settled_count += queue.make_room(settle);
    queue.push({finishes_at, &clock, &waited});
  }
  EXPECT_EQ(settled, (std::vector<int>{10}));
  EXPECT_TRUE(waited.empty());
  EXPECT_EQ(clock, 0);
  EXPECT_EQ(settled_count, 1);
  EXPECT_EQ(queue.size(), 2u);
}

TEST(InflightQueue, ZeroMeansUnlimited) {
  int clock = 0;
  std::vector<int> waited;
  fsdp::InflightQueue<FakeWork> queue(0);
  int blocked = 0;
  for (int i = 1; i <= 100; ++i) {
    blocked += queue.make_room();
    queue.push({i, &clock, &waited});
  }
  EXPECT_EQ(blocked, 0);
  EXPECT_EQ(queue.size(), 100u);
}

TEST(HostWorker, RunsJobsInOrderOffTheCallersThread) {
  std::vector<int> ran;
  std::vector<std::thread::id> threads;
  fsdp::HostWorker worker;
  for (int i = 0; i < 5; ++i)
    worker.submit(
        [&, i] {
          ran.push_back(i);
          threads.push_back(std::this_thread::get_id());
        },
        10);
  worker.wait_all();  // orders the jobs' writes before the reads below
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2, 3, 4}));
  for (const auto& id : threads) EXPECT_NE(id, std::this_thread::get_id());
  EXPECT_EQ(worker.pending(), 0);
}

TEST(HostWorker, ASubmitPastTheCapWaitsForTheOldestJob) {
  fsdp::HostWorker worker;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  EXPECT_FALSE(worker.submit([released] { released.wait(); }, 1));
  std::atomic<bool> queued{false};
  std::thread second([&] {
    EXPECT_TRUE(worker.submit([] {}, 1));  // the first is pending: waits for it
    queued = true;
  });
  // Only the release lets it through: with the cap broken it would be queued at once.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(queued);
  EXPECT_EQ(worker.pending(), 1);
  release.set_value();
  second.join();
  EXPECT_TRUE(queued);
  worker.wait_all();
  EXPECT_EQ(worker.pending(), 0);
  EXPECT_THROW(worker.submit([] {}, 0), std::invalid_argument);
}

TEST(HostWorker, AJobsExceptionIsRethrownOnceAndTheRestStillRun) {
  fsdp::HostWorker worker;
  int ran = 0;
  worker.submit([] { throw std::runtime_error("first failure"); }, 4);
  worker.submit([] { throw std::runtime_error("second failure"); }, 4);
  worker.submit([&] { ++ran; }, 4);
  try {
    worker.wait_all();
    ADD_FAILURE() << "wait_all did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first failure");
  }
  EXPECT_EQ(ran, 1);
  EXPECT_NO_THROW(worker.wait_all());
}

TEST(HostWorker, DestructionRunsWhatIsQueued) {
  std::atomic<int> ran{0};
  {
    fsdp::HostWorker worker;
    for (int i = 0; i < 3; ++i)
      worker.submit([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        ++ran;
      }, 3);
  }
  EXPECT_EQ(ran, 3);
}

struct FakeEnv {
  std::map<std::string, std::string> vars;
  fsdp::LaunchEnv parse() const {
    return fsdp::parse_launch_env([this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  }
};

TEST(Version, IsMajorMinorPatch) {
  EXPECT_TRUE(std::regex_match(fsdp::version(), std::regex("[0-9]+\\.[0-9]+\\.[0-9]+"))) << fsdp::version();
}

TEST(LaunchEnv, NoLauncherIsOneProcess) {
  auto env = FakeEnv{}.parse();
  EXPECT_EQ(env.launcher, fsdp::LaunchEnv::Launcher::Single);
  EXPECT_EQ(env.world_size, 1);
}

TEST(LaunchEnv, Torchrun) {
  auto env = FakeEnv{{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                      {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}}}
                 .parse();
  EXPECT_EQ(env.launcher, fsdp::LaunchEnv::Launcher::Torchrun);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_FALSE(env.agent_store);  // fsdp-run: rank 0 serves the store
  // torchrun: its agent serves it; a restarted worker group uses keys of its own.
  auto under_agent = FakeEnv{{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "h"},
                              {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                              {"TORCHELASTIC_RESTART_COUNT", "2"}}}
                         .parse();
  EXPECT_TRUE(under_agent.agent_store);
  EXPECT_EQ(under_agent.restart_count, 2);
}

TEST(LaunchEnv, Mpirun) {
  auto env = FakeEnv{{{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "3"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}}
                 .parse();
  EXPECT_EQ(env.launcher, fsdp::LaunchEnv::Launcher::Mpirun);
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_TRUE(env.master_addr.empty());
}

// srun: each task's rank, count and GPU from SLURM's variables; GPU ranks meet at the step's first
// node on a port from the job id, unless MASTER_ADDR/MASTER_PORT say otherwise.
TEST(LaunchEnv, Srun) {
  auto env = FakeEnv{{{"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_NTASKS", "8"},
                      {"SLURM_LOCALID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
                      {"SLURM_STEP_NODELIST", "gpu[07-08,12],cpu1"}, {"SLURM_JOB_ID", "123456"}}}
                 .parse();
  EXPECT_EQ(env.launcher, fsdp::LaunchEnv::Launcher::Slurm);
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "gpu07");
  EXPECT_EQ(env.master_port, 29500 + 456);
  auto told = FakeEnv{{{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_STEP_NODELIST", "a1,a2"},
                       {"MASTER_ADDR", "10.1.1.1"}, {"MASTER_PORT", "4000"}}}
                  .parse();
  EXPECT_EQ(told.master_addr, "10.1.1.1");
  EXPECT_EQ(told.master_port, 4000);
  const auto first_node = FakeEnv{{{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_STEP_NODELIST", "a1,a2"}}}.parse();
  EXPECT_EQ(first_node.master_addr, "a1");
  // An allocation's batch script with one task is one process.
  const auto batch_script = FakeEnv{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}}.parse();
  EXPECT_EQ(batch_script.launcher, fsdp::LaunchEnv::Launcher::Single);
  // torchrun inside an allocation: its own variables win.
  const auto torchrun_inside = FakeEnv{{{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "1"}, {"RANK", "1"},
                                        {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"},
                                        {"MASTER_PORT", "1"}}}.parse();
  EXPECT_EQ(torchrun_inside.launcher, fsdp::LaunchEnv::Launcher::Torchrun);
}

// MPICH's or Intel MPI's launcher: PMI's rank and size; a place to meet only if the user gives one.
TEST(LaunchEnv, PmiLaunchers) {
  auto env = FakeEnv{{{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "3"}, {"MPI_LOCALNRANKS", "4"}}}
                 .parse();
  EXPECT_EQ(env.launcher, fsdp::LaunchEnv::Launcher::Pmi);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 3);
  EXPECT_TRUE(env.master_addr.empty());  // a GPU communicator refuses it (fault_pmi_without_master)
}

void expect_error(const FakeEnv& env, const std::string& needle) {
  try {
    env.parse();
    FAIL() << "expected an error containing: " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(LaunchEnv, MissingOrContradictoryVariablesAreNamed) {
  expect_error(FakeEnv{{{"RANK", "0"}}}, "WORLD_SIZE is not set");
  expect_error(FakeEnv{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}},
               "MASTER_ADDR is not set");
  expect_error(FakeEnv{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "1"}}},
               "LOCAL_RANK is not set");
  expect_error(FakeEnv{{{"RANK", "x"}, {"WORLD_SIZE", "2"}}}, "RANK='x' is not an integer");
  expect_error(FakeEnv{{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"},
                        {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}},
               "rank 2 is outside the world of 2");
  expect_error(FakeEnv{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"},
                        {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}},
               "MASTER_PORT=70000 is not a TCP port");
  expect_error(FakeEnv{{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"},
                        {"OMPI_COMM_WORLD_SIZE", "2"}}},
               "contradictory launch environment");
  expect_error(FakeEnv{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}},
               "SLURM_NTASKS=4 but this process was not started by srun");
  expect_error(FakeEnv{{{"PMI_RANK", "0"}}}, "PMI_SIZE is not set, but PMI_RANK is");
  expect_error(FakeEnv{{{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"MASTER_ADDR", "h"}}}, "MASTER_PORT is not set");
}

// The near-normal initialisation: over 2^20 values the sample mean lies within 5 standard errors
// (5 * std / 2^10) of 0 and the sample standard deviation within 1% of std (its standard error
// is std * sqrt((kurtosis - 1) / n) ~ std / 1500 here); every value within the +-sqrt(3) * 2 * std
// bound of a sum of four uniforms; another seed gives uncorrelated values (|r| < 10 / sqrt(n)).
TEST(InitNormal, MeanStdBoundsAndSeeds) {
  const double std = 0.02;
  at::Tensor a = torch::empty({1024, 1024}), b = torch::empty({1024, 1024});
  fsdp::init_normal_(a, 7, std);
  fsdp::init_normal_(b, 8, std);
  EXPECT_LT(std::abs(a.mean().item<double>()), 5 * std / 1024);
  EXPECT_NEAR(a.std().item<double>(), std, 0.01 * std);
  EXPECT_LE(a.abs().max().item<double>(), 2 * std::sqrt(3.0) * std * (1 + 1e-6));
  EXPECT_LT(std::abs(torch::corrcoef(torch::stack({a.view(-1), b.view(-1)}))[0][1].item<double>()), 0.01);
  at::Tensor again = torch::empty({1024, 1024});
  fsdp::init_normal_(again, 7, std);
  EXPECT_TRUE(torch::equal(a, again));
}

// The CPU's loop gives init_normal_'s numbers bit for bit as the tensor operations a GPU runs,
// across the 2^31 boundary (int64 lanes) and up to the last position hashed (2^32 - 1).
TEST(InitNormal, CpuLoopEqualsTensorOps) {
  for (uint64_t seed : {uint64_t(7), uint64_t(0x123456789abcdefull)}) {
    const auto keys = fsdp::init_detail::stream_keys(seed);
    for (int64_t first : {int64_t(0), (int64_t(1) << 31) - 5000, (int64_t(1) << 32) - 10000}) {
      const at::Tensor positions = torch::arange(first, first + 10000, torch::kLong);
      const at::Tensor by_ops = fsdp::init_detail::hashed_sums_by_tensor_ops(positions, keys);
      const at::Tensor by_loop = fsdp::init_detail::hashed_sums_by_loop(positions, keys);
      EXPECT_TRUE(torch::equal(by_ops, by_loop)) << "seed " << seed << ", first " << first;
    }
  }
}

// The clip as a divisor: norm / max_norm (plus clip_grad_norm_'s 1e-6) above max_norm, 1 below it.
TEST(ClipDivisor, IsTheNormOverMaxNormAtLeastOne) {
  EXPECT_FLOAT_EQ(fsdp::clip_divisor(torch::full({}, 3.0f), 1.5).item<float>(), 2.0f);
  EXPECT_FLOAT_EQ(fsdp::clip_divisor(torch::full({}, 2e-6f), 1e-6).item<float>(), 3.0f);  // the 1e-6 counts
  EXPECT_EQ(fsdp::clip_divisor(torch::full({}, 0.5f), 2.0).item<float>(), 1.0f);
}

// fsdp::recompute on a module that is not sharded: the same output as a plain call, and backward
// through the recomputation gives the same gradients.
TEST(Recompute, GivesThePlainCallsResults) {
  torch::manual_seed(0);
  torch::nn::Linear linear(4, 3);
  const at::Tensor x = torch::randn({2, 4});
  const at::Tensor plain = linear(x);
  plain.sum().backward();
  const at::Tensor plain_grad = linear->weight.grad().clone();
  linear->zero_grad();
  const at::Tensor y = fsdp::recompute(linear, x);
  EXPECT_TRUE(torch::equal(y, plain));
  y.sum().backward();
  EXPECT_TRUE(torch::equal(linear->weight.grad(), plain_grad));
}

// Every knob is checked, compared and named through for_each_runtime_option.
TEST(RuntimeOptions, EachKnobIsComparedAndRangeChecked) {
  fsdp::for_each_runtime_option([](const char* name, auto member, const char*) {
    fsdp::RuntimeOptions changed;
    changed.*member = -1;
    EXPECT_FALSE(changed == fsdp::RuntimeOptions{}) << name;
    try {
      fsdp::check_runtime_options(changed, "test");
      ADD_FAILURE() << name << " = -1 was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("test: ") + name + " is -1"), std::string::npos) << e.what();
    }
  });
  EXPECT_TRUE(fsdp::RuntimeOptions{} == fsdp::RuntimeOptions{});
}

}  // namespace

// A coalesced collective's pieces (one per parameter of each group) in an error: their total size
// and count, not one size each (a block has dozens of parameters).
struct BatchText : fsdp::Communicator {
  using Communicator::Buffers;
  using Communicator::describe_batch;
};

TEST(Communicator, ABatchIsDescribedByItsTotalAndItsPieces) {
  const auto buffers = [](int64_t n) {
    return BatchText::Buffers{at::empty({2 * n}, at::kFloat), at::empty({n}, at::kFloat)};
  };
  EXPECT_EQ(BatchText::describe_batch("all_gather", {buffers(256), buffers(128)}, "#3 Block"),
            "all_gather of 1536 bytes in 2 pieces (#3 Block)");
  EXPECT_EQ(BatchText::describe_batch("reduce_scatter(avg)", {buffers(1)}, ""), "reduce_scatter(avg) of 4 bytes");
}
