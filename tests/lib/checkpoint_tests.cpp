// Sharded checkpoints across ranks: a round trip restores every shard exactly, and a damaged or
// foreign checkpoint is refused on every rank, naming the file and the problem.
#include <unistd.h>

#include <algorithm>
#include <fstream>

#include "helpers.h"
#include "io/files.h"

namespace fsdp::testing {
namespace {

std::string load_error(const std::string& dir, CheckpointState& state) {
  try {
    load_checkpoint(dir, state);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(loaded)";
}

// Rank 0 changes the files; the others wait until it has.
template <class F>
void on_rank0(F&& change) {
  if (world()->rank() == 0) change();
  world()->barrier();
}

TEST(Checkpoint, RoundTripRestoresEveryShard) {
  auto m = seeded_llama(tiny_llama());
  shard_blocks_and_root(m);
  CheckpointState state = model_state(*m);
  state.add_replicated("counter", torch::tensor({7.5f}, on_device()));
  state.extra["step"] = "42";
  std::vector<at::Tensor> saved;
  for (const auto& t : state.sharded()) saved.push_back(t.local.detach().clone());
  const std::string dir = shared_dir("roundtrip");
  // Told as this rank's file is written: each tensor's bytes, rising to every byte it holds.
  int64_t mine = 0;
  for (const auto& t : state.sharded()) mine += static_cast<int64_t>(t.local.nbytes());
  std::vector<std::pair<int64_t, int64_t>> told;
  state.progress = [&told](int64_t done, int64_t total) { told.emplace_back(done, total); };
  save_checkpoint(dir, state);
  ASSERT_EQ(told.size(), state.sharded().size());
  EXPECT_EQ(told.back(), std::make_pair(mine, mine));
  EXPECT_TRUE(std::is_sorted(told.begin(), told.end()));
  EXPECT_TRUE(io::exists(dir + "/metadata.bin"));
  {  // the library's version is recorded
    std::ifstream meta(dir + "/metadata.bin", std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(meta)), {});
    EXPECT_NE(bytes.find(std::string("fsdp.cpp ") + version()), std::string::npos);
  }
  EXPECT_FALSE(io::exists(dir + ".tmp"));
  EXPECT_EQ(newest_checkpoint(io::parent_of(dir)).empty(), true);  // not named step-N
  {
    torch::NoGradGuard no_grad;
    for (const auto& t : state.sharded()) t.local.zero_();
  }
  state.replicated()[0].second.zero_();
  state.extra.clear();
  told.clear();
  load_checkpoint(dir, state);  // every block read twice: its checksum checked, then copied
  ASSERT_FALSE(told.empty());
  EXPECT_EQ(told.back(), std::make_pair(2 * mine, 2 * mine));
  EXPECT_TRUE(std::is_sorted(told.begin(), told.end()));
  state.progress = nullptr;
  for (size_t i = 0; i < saved.size(); ++i)
    EXPECT_TRUE(torch::equal(state.sharded()[i].local, saved[i])) << state.sharded()[i].name;
  EXPECT_EQ(state.replicated()[0].second.item<float>(), 7.5f);
  EXPECT_EQ(state.extra.at("step"), "42");
  on_rank0([&] { io::remove_tree(dir); });
}

TEST(Checkpoint, DamagedOrForeignCheckpointsAreRefusedOnEveryRank) {
  using ::testing::HasSubstr;
  auto m = seeded_llama(tiny_llama());
  shard_blocks_and_root(m);
  CheckpointState state = model_state(*m);
  const std::string dir = shared_dir("damaged");
  const int last = world()->world_size() - 1;
  const std::string first_file = dir + "/shard-0-of-" + std::to_string(last + 1) + ".bin";
  const std::string last_file = dir + "/shard-" + std::to_string(last) + "-of-" + std::to_string(last + 1) + ".bin";
  // Rank 0 always reads saved rank 0's rows, the last rank the last saved rank's.
  save_checkpoint(dir, state);
  on_rank0([&] {
    std::fstream f(first_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x7f');
  });
  const std::string flipped = load_error(dir, state);
  if (world()->rank() == 0) EXPECT_THAT(flipped, HasSubstr(first_file + ": checksum mismatch in"));
  else EXPECT_THAT(flipped, HasSubstr("loading " + dir + " failed on 1 other rank(s)"));

  save_checkpoint(dir, state);
  on_rank0([&] { ASSERT_EQ(::truncate(last_file.c_str(), io::file_size(last_file) - 3), 0); });
  const std::string cut = load_error(dir, state);
  if (world()->rank() == last) EXPECT_THAT(cut, HasSubstr(last_file + ": "));
  if (world()->rank() == last) EXPECT_THAT(cut, HasSubstr("the checkpoint is incomplete or damaged"));
  else EXPECT_THAT(cut, HasSubstr("failed on 1 other rank(s)"));

  save_checkpoint(dir, state);
  on_rank0([&] { io::remove_tree(dir + "/metadata.bin"); });
  EXPECT_THAT(load_error(dir, state), HasSubstr(dir + "/metadata.bin: missing"));

  save_checkpoint(dir, state);
  auto other_config = tiny_llama();
  other_config.ffn = 40;
  auto other = seeded_llama(other_config);
  shard_blocks_and_root(other);
  CheckpointState other_state = model_state(*other);
  EXPECT_THAT(load_error(dir, other_state), HasSubstr("a checkpoint of another model or dtype"));
  on_rank0([&] { io::remove_tree(dir); });
}

// A load that fails changes nothing: the checkpoint is checked whole (names, shapes, counts, every
// block's checksum) on every rank before any rank copies a byte. Before, the ranks copied tensor
// by tensor until one failed: a damaged last block or a model with one more block than the
// checkpoint left the state half overwritten.
TEST(Checkpoint, AFailedLoadLeavesTheStateAsItWas) {
  const std::string dir = shared_dir("unchanged");
  {
    auto saved = seeded_llama(tiny_llama(), /*seed=*/11);
    shard_blocks_and_root(saved);
    CheckpointState state = model_state(*saved);
    state.add_replicated("counter", torch::tensor({7.5f}, on_device()));
    save_checkpoint(dir, state);
  }
  const auto expect_unchanged_by_a_failed_load = [&](TestLlamaConfig config, const char* what) {
    auto m = seeded_llama(config, /*seed=*/5);
    shard_blocks_and_root(m);
    CheckpointState state = model_state(*m);
    state.add_replicated("counter", torch::tensor({-1.0f}, on_device()));
    std::vector<at::Tensor> before;
    for (const auto& t : state.sharded()) before.push_back(t.local.detach().clone());
    EXPECT_NE(load_error(dir, state), "(loaded)") << what;
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(torch::equal(state.sharded()[i].local, before[i])) << what << ": " << state.sharded()[i].name;
    EXPECT_EQ(state.replicated()[0].second.item<float>(), -1.0f) << what;
  };
  auto deeper = tiny_llama();
  deeper.n_layers = 3;
  expect_unchanged_by_a_failed_load(deeper, "a model with one more block");
  // The last byte of the last saved rank's file: the last tensor's block, read after all others.
  const int world_size = world()->world_size();
  const std::string last_file =
      dir + "/shard-" + std::to_string(world_size - 1) + "-of-" + std::to_string(world_size) + ".bin";
  on_rank0([&] {
    std::fstream f(last_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 0x40));
  });
  expect_unchanged_by_a_failed_load(tiny_llama(), "a damaged last block");
  on_rank0([&] { io::remove_tree(dir); });
}

}  // namespace
}  // namespace fsdp::testing
