// HSDP (fsdp/mesh.h): every layout of replicas x shards the world size allows trains as
// single-process training does, and checkpoints move between HSDP and plain FSDP; with a tp
// dimension, the communicators join the ranks init_device_mesh's layout puts together, and
// tensor-parallel parts and collectives (fsdp/tensor_parallel.h) keep their contracts.
// mpi_4_ranks runs 1x4, 2x2 and 4x1; mpi_6_ranks_hsdp 2x3 (uneven shards) and the rest of 6's.
#include "helpers.h"
#include "io/files.h"

namespace fsdp::testing {
namespace {

std::vector<int> replica_counts() {
  std::vector<int> out;
  for (int r = 1; r <= world()->world_size(); ++r)
    if (world()->world_size() % r == 0) out.push_back(r);
  return out;
}

ShardOptions on_mesh(const Mesh& mesh) {
  ShardOptions o;
  o.comm = mesh.shard;
  o.replicate = mesh.replicate;
  return o;
}

TrainSetup hsdp_setup(const ShardOptions& o, uint64_t seed = 5) {
  return llama_setup(seeded_llama(tiny_llama(), seed), [o](TestLlama& m) { shard_blocks_and_root(m, o); });
}

// Clipping included: the gradient norm must sum each shard once, not once per replica.
TEST(Hsdp, EveryLayoutMatchesSingleProcess) {
  const double clip = 0.05;
  auto reference = llama_setup(seeded_llama(tiny_llama()));
  reference.clip = clip;
  const TrainResult want = train(reference);
  for (int replicas : replica_counts()) {
    const int shards = world()->world_size() / replicas;
    SCOPED_TRACE(std::to_string(replicas) + " replicas x " + std::to_string(shards) + " shards");
    const Mesh mesh = make_mesh(replicas);
    ASSERT_EQ(mesh.shard->world_size(), shards);
    ASSERT_EQ(mesh.replicas(), replicas);
    EXPECT_EQ(mesh.shard->rank(), world()->rank() % shards);
    EXPECT_EQ(mesh.replicate->rank(), world()->rank() / shards);
    auto s = hsdp_setup(on_mesh(mesh));
    s.clip = clip;
    const TrainResult got = train(s);
    expect_same_run(got, want);
    if (replicas == 2 || replicas == world()->world_size()) {
      // Offloaded: the host copy follows the all-reduce. Placement only: on CPU ranks bit-identical.
      ShardOptions offloaded = on_mesh(mesh);
      offloaded.cpu_offload = true;
      auto o = hsdp_setup(offloaded);
      o.clip = clip;
      const TrainResult off = train(o);
      if (device().is_cpu()) expect_identical_run(off, got);
      else expect_same_run(off, want);
    }
  }
}

TEST(Hsdp, CheckpointsMoveBetweenHsdpAndPlainFsdp) {
  const int replicas = replica_counts().size() > 1 ? replica_counts()[1] : 1;  // the smallest above 1
  const int shards = world()->world_size() / replicas;
  const ShardOptions hsdp = on_mesh(make_mesh(replicas));
  at::Tensor pid = torch::tensor({static_cast<int64_t>(getpid())}, on_device(at::kLong));
  world()->broadcast(pid, 0);
  const std::string dir = ::testing::TempDir() + "fsdp_hsdp_" + std::to_string(pid.item<int64_t>());
  if (world()->rank() == 0) io::make_directories(dir);
  world()->barrier();

  auto saved = seeded_llama(tiny_llama(), 5);
  shard_blocks_and_root(saved, hsdp);
  save_checkpoint(dir + "/hsdp", model_state(*saved));
  // One replica wrote it: one file per rank of a replica.
  EXPECT_TRUE(io::exists(dir + "/hsdp/shard-" + std::to_string(shards - 1) + "-of-" + std::to_string(shards) + ".bin"));
  const auto want = full_state_dict(*saved);

  auto plain = seeded_llama(tiny_llama(), 9);
  shard_blocks_and_root(plain);
  CheckpointState plain_state = model_state(*plain);
  load_checkpoint(dir + "/hsdp", plain_state);
  expect_identical_run({{}, {}, full_state_dict(*plain)}, {{}, {}, want});
  save_checkpoint(dir + "/plain", plain_state);
  // The same written in the background (start_checkpoint_save): one replica writes, all publish.
  start_checkpoint_save(dir + "/hsdp-async", model_state(*saved))->finish();
  auto from_async = seeded_llama(tiny_llama(), 17);
  shard_blocks_and_root(from_async);
  CheckpointState async_state = model_state(*from_async);
  load_checkpoint(dir + "/hsdp-async", async_state);
  expect_identical_run({{}, {}, full_state_dict(*from_async)}, {{}, {}, want});

  auto back = seeded_llama(tiny_llama(), 13);
  shard_blocks_and_root(back, hsdp);
  CheckpointState back_state = model_state(*back);
  load_checkpoint(dir + "/plain", back_state);
  expect_identical_run({{}, {}, full_state_dict(*back)}, {{}, {}, want});
  world()->barrier();
  if (world()->rank() == 0) io::remove_tree(dir);
}

// Every (replicas, shards, tp) layout with tp > 1: rank r = (replica * shards + shard) * tp + t.
TEST(Hsdp, TpDimensionJoinsTheRanksOfInitDeviceMeshsLayout) {
  const int world_size = world()->world_size(), r = world()->rank();
  const auto ranks_of = [&](Communicator& comm) {
    at::Tensor all = at::empty({comm.world_size()}, at::TensorOptions().dtype(at::kLong).device(device()));
    comm.all_gather(all, at::full({1}, r, all.options()));
    const at::Tensor host = all.cpu();
    return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + comm.world_size());
  };
  for (int tp = 2; tp <= world_size; ++tp) {
    if (world_size % tp != 0) continue;
    for (int replicas = 1; replicas <= world_size / tp; ++replicas) {
      if ((world_size / tp) % replicas != 0) continue;
      const int shards = world_size / tp / replicas, t = r % tp, shard = r / tp % shards, replica = r / tp / shards;
      SCOPED_TRACE(std::to_string(replicas) + " x " + std::to_string(shards) + " x tp " + std::to_string(tp));
      const Mesh mesh = make_mesh(replicas, world(), tp);
      std::vector<int64_t> want_shard, want_replicate, want_tp;
      for (int s = 0; s < shards; ++s) want_shard.push_back((replica * shards + s) * tp + t);
      for (int p = 0; p < replicas; ++p) want_replicate.push_back((p * shards + shard) * tp + t);
      for (int u = 0; u < tp; ++u) want_tp.push_back((replica * shards + shard) * tp + u);
      EXPECT_EQ(ranks_of(*mesh.shard), want_shard);
      EXPECT_EQ(ranks_of(*mesh.replicate), want_replicate);
      EXPECT_EQ(ranks_of(*mesh.tp), want_tp);
    }
  }
}

// A module holding one tensor-parallel part of a [12, 6] parameter, sharded over the mesh's shard ranks.
struct PartHolder : torch::nn::Module {
  explicit PartHolder(TpPart part) {
    weight = register_parameter("weight", deferred_parameter(part.part_shape(), at::TensorOptions().device(device())));
    set_tp_part(weight, std::move(part));
  }
  torch::Tensor weight;
};

// fsdp/tensor_parallel.h on every tp degree the world allows: a part initialised after sharding
// holds its place's values of the full parameter (init_normal_ on the whole, one process), which
// full_parameter assembles again, for parts of rows in sections (a fused projection) and of
// columns; the tp collectives' forwards and backwards move what their contracts say.
TEST(Hsdp, TensorParallelPartsAndCollectives) {
  using ::testing::HasSubstr;
  const at::Tensor whole = at::empty({12, 6}, at::TensorOptions().device(device()));
  init_normal_(whole, 11, 0.02);
  for (int tp = 2; tp <= world()->world_size(); ++tp) {
    if (world()->world_size() % tp != 0 || 6 % tp != 0) continue;
    SCOPED_TRACE("tp " + std::to_string(tp));
    const Mesh mesh = make_mesh(1, world(), tp);
    for (const TpPart& part : {TpPart{mesh.tp, mesh.replica, 0, {6, 6}, {12, 6}}, TpPart{mesh.tp, mesh.replica, 1, {6}, {12, 6}}}) {
      SCOPED_TRACE("dim " + std::to_string(part.dim));
      auto holder = std::make_shared<PartHolder>(part);
      ShardOptions o;
      o.comm = mesh.shard;
      fully_shard(*holder, o);
      init_normal_(holder->weight, 11, 0.02);
      EXPECT_TRUE(at::equal(full_parameter(holder->weight), whole));
      at::Tensor mine = part.part_of(whole);
      EXPECT_EQ(mine.sizes().vec(), part.part_shape());
      if (part.dim == 0)  // this rank's rows of each section, one after the other
        EXPECT_TRUE(at::equal(mine.narrow(0, 0, 6 / tp), whole.narrow(0, mesh.tp->rank() * (6 / tp), 6 / tp)));
    }
    // Rows: rank t holds rows [t * 2, t * 2 + 2) of x (values t * 2 + i); the backward passes
    // check the gradients against the sums each contract implies.
    const int t = mesh.tp->rank();
    const auto options = at::TensorOptions().dtype(at::kDouble).device(device());
    const at::Tensor all = at::arange(2 * tp, options).unsqueeze(1).repeat({1, 3});
    at::Tensor x = all.narrow(0, 2 * t, 2).clone().requires_grad_(true);
    const at::Tensor gathered = tp::gather_rows(x, *mesh.tp);
    EXPECT_TRUE(at::equal(gathered, all));
    (gathered * (t + 1)).sum().backward();  // rank t weighs every row by t + 1: the sum over ranks
    EXPECT_TRUE(at::allclose(x.grad(), at::full({2, 3}, tp * (tp + 1) / 2.0, options)));
    at::Tensor y = all.clone().mul_(t + 1).requires_grad_(true);  // partial sums: rank t's is (t + 1) x all
    const at::Tensor reduced = tp::scatter_rows(y, *mesh.tp);
    EXPECT_TRUE(at::allclose(reduced, all.narrow(0, 2 * t, 2) * (tp * (tp + 1) / 2.0)));
    (reduced * (t + 1)).sum().backward();  // the gradient of every row: its owner's weight
    EXPECT_TRUE(at::allclose(y.grad(), at::arange(1, tp + 1, options).repeat_interleave(2).unsqueeze(1).expand({-1, 3})));
    at::Tensor w = at::ones({3}, options).requires_grad_(true);
    (tp::copy_in(w, *mesh.tp) * (t + 1)).sum().backward();
    EXPECT_TRUE(at::allclose(w.grad(), at::full({3}, tp * (tp + 1) / 2.0, options)));
    try {
      tp::scatter_rows(at::ones({2 * tp + 1, 3}, options), *mesh.tp);
      ADD_FAILURE() << "no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("rows do not split over " + std::to_string(tp) + " tp ranks"));
    }
  }
}

// A communicator that issues through another and writes each collective it issues into a log
// shared with others: the order in which the runtime and the tp collectives issue theirs.
class Recording : public Communicator {
 public:
  Recording(std::shared_ptr<Communicator> inner, std::string label, std::vector<std::string>& log)
      : Communicator(inner->rank(), inner->world_size(), inner->name(), inner->timeout()),
        inner_(std::move(inner)), label_(std::move(label)), log_(log) {}
  const char* backend() const override { return inner_->backend(); }
  at::Device device() const override { return inner_->device(); }

 protected:
  void do_all_gather(const std::vector<Buffers>& ops, const std::string& tag) override {
    log_.push_back(label_ + " all_gather " + tag);
    std::vector<at::Tensor> outputs, inputs;
    for (const auto& b : ops) outputs.push_back(b.output), inputs.push_back(b.input);
    inner_->all_gather_coalesced(outputs, inputs, tag);
  }
  void do_reduce_scatter(const std::vector<Buffers>& ops, ReduceOp op, const std::string& tag) override {
    log_.push_back(label_ + " reduce_scatter " + tag);
    std::vector<at::Tensor> outputs, inputs;
    for (const auto& b : ops) outputs.push_back(b.output), inputs.push_back(b.input);
    inner_->reduce_scatter_coalesced(outputs, inputs, op, tag);
  }
  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override { inner_->all_reduce(tensor, op); }
  void do_broadcast(const at::Tensor& tensor, int root) override { inner_->broadcast(tensor, root); }
  void do_barrier() override { inner_->barrier(); }
  std::shared_ptr<Communicator> do_split(int color, int key, std::string name) override {
    return inner_->split(color, key, name);
  }

 private:
  std::shared_ptr<Communicator> inner_;
  std::string label_;
  std::vector<std::string>& log_;
};

// A block of tensor-parallel projections as the trainer's: the tokens gathered, a column-parallel
// part, a row-parallel part, the partial sums scattered back.
struct TpBlock : torch::nn::Module {
  TpBlock(const Mesh& mesh, Communicator& tp) : tp_(tp) {
    const auto on = at::TensorOptions().device(device());
    TpPart columns{mesh.tp, mesh.replica, 0, {8}, {8, 4}}, rows{mesh.tp, mesh.replica, 1, {8}, {4, 8}};
    up = register_parameter("up", deferred_parameter(columns.part_shape(), on));
    down = register_parameter("down", deferred_parameter(rows.part_shape(), on));
    set_tp_part(up, columns);
    set_tp_part(down, rows);
  }
  at::Tensor forward(const at::Tensor& x) {
    return x + tp::scatter_rows(at::linear(at::linear(tp::gather_rows(x, tp_), up), down), tp_);
  }
  torch::Tensor up, down;
  Communicator& tp_;
};

struct TpBlocks : torch::nn::Module {
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks) x = fsdp::forward(block, x);
    return x;
  }
  std::vector<std::shared_ptr<TpBlock>> blocks;
};

// The tp collectives, issued inside a block's forward and backward, never hold back FSDP's (the
// order in which each rank issues them, in a step after the first, once the runtime knows the
// execution order): in forward block i + 1's all-gather goes out before block i's tp collectives
// (prefetch); in backward block i - 1's all-gather before block i's tp collectives, and block i's
// reduce-scatter as soon as its weights' gradients exist, before block i - 1's tp collectives.
// The root holds no parameter of its own but takes part like a group (its empty collectives come
// first and last).
TEST(Hsdp, TensorParallelCollectivesNeverHoldBackFsdps) {
  const int tp_degree = 2, blocks = 3;
  if (world()->world_size() % tp_degree != 0 || world()->world_size() < 2 * tp_degree)
    GTEST_SKIP() << "needs an even number of ranks, 4 or more (one rank alone reduces nothing)";
  const Mesh mesh = make_mesh(1, world(), tp_degree);
  std::vector<std::string> log;
  auto shard = std::make_shared<Recording>(mesh.shard, "dp", log);
  Recording tp(mesh.tp, "tp", log);
  auto model = std::make_shared<TpBlocks>();
  ShardOptions o;
  o.comm = shard;
  for (int i = 0; i < blocks; ++i) {
    model->blocks.push_back(model->register_module("block" + std::to_string(i), std::make_shared<TpBlock>(mesh, tp)));
    fully_shard(*model->blocks.back(), o);
    init_normal_(model->blocks.back()->up, 1 + i, 0.1);
    init_normal_(model->blocks.back()->down, 11 + i, 0.1);
  }
  fully_shard(*model, o);
  const auto step = [&] {
    log.clear();
    // This rank's 4 token rows; a gradient wanted for them, so block 0's gather runs backward too.
    const at::Tensor x = at::ones({4, 4}, at::TensorOptions().device(device())).requires_grad_(true);
    fsdp::forward(model, x).sum().backward();
  };
  step();
  step();
  const auto position = [&](const std::string& what, int nth) {  // of the nth log line starting with `what`
    int seen = 0;
    for (size_t i = 0; i < log.size(); ++i)
      if (log[i].rfind(what, 0) == 0 && seen++ == nth) return static_cast<int>(i);
    return -1;
  };
  const auto count = [&](const std::string& what) {
    return std::count_if(log.begin(), log.end(), [&](const std::string& line) { return line.rfind(what, 0) == 0; });
  };
  const auto listed = [&] {
    std::string text;
    for (const auto& line : log) text += "\n  " + line;
    return text;
  };
  const std::string order = listed();
  EXPECT_EQ(count("dp all_gather"), 1 + 2 * blocks) << order;  // the root, each block in forward and backward
  EXPECT_EQ(count("dp reduce_scatter"), blocks + 1) << order;
  EXPECT_EQ(count("tp all_gather"), 2 * blocks) << order;  // forward's gather, backward's of the scatter
  EXPECT_EQ(count("tp reduce_scatter"), 2 * blocks) << order;
  for (int i = 0; i + 1 < blocks; ++i)  // dp all-gather 0 is the root's, i + 1 block i's
    EXPECT_LT(position("dp all_gather", i + 2), position("tp all_gather", i)) << "forward, block " << i << order;
  // Backward takes the blocks last to first: its k-th block's tp collectives are the (blocks + k)-th
  // of each kind, its all-gather the (1 + blocks + k)-th, its reduce-scatter the k-th.
  for (int k = 0; k + 1 < blocks; ++k) {
    SCOPED_TRACE("backward, block " + std::to_string(blocks - 1 - k));
    EXPECT_LT(position("dp all_gather", 1 + blocks + k + 1), position("tp all_gather", blocks + k)) << order;
    EXPECT_LT(position("dp reduce_scatter", k), position("tp all_gather", blocks + k + 1)) << order;
  }
  // Buckets holding every group: one all-gather a pass, issued before the pass's first tp
  // collective; the reduce-scatters coalesced too (the bucket goes out when the root's gradients,
  // last, join it).
  RuntimeOptions bucketed = runtime_options();
  bucketed.bucket_mb = 1;
  set_runtime_options(*model, bucketed);
  step();  // options take effect from the next step
  step();
  const std::string bucketed_order = listed();
  EXPECT_EQ(count("dp all_gather"), 2) << bucketed_order;
  EXPECT_EQ(count("dp reduce_scatter"), 1) << bucketed_order;
  EXPECT_EQ(count("tp all_gather"), 2 * blocks) << bucketed_order;
  EXPECT_LT(position("dp all_gather", 0), position("tp all_gather", 0)) << bucketed_order;
  EXPECT_LT(position("dp all_gather", 1), position("tp all_gather", blocks)) << bucketed_order;
}

TEST(Hsdp, BadLayoutsAreErrors) {
  using ::testing::HasSubstr;
  const int world_size = world()->world_size();
  try {
    make_mesh(world_size + 1);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr(std::to_string(world_size + 1) + " replicas do not divide the " +
                                    std::to_string(world_size) + " ranks"));
  }
  if (world_size < 2) return;
  // Replicas of the whole world joined with the world as the shard communicator: the replicate communicator's
  // ranks hold different shards.
  ShardOptions wrong;
  wrong.comm = world();
  wrong.replicate = make_mesh(world_size).replicate;
  auto m = seeded_llama(tiny_llama());
  try {
    fully_shard(m->blocks[0], wrong);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("a replicate communicator joins the ranks holding the same shard"));
  }
  // Replicas that build different models (each shard communicator of one rank agrees with itself).
  const Mesh mesh = make_mesh(world_size);
  ShardOptions replicated;
  replicated.comm = mesh.shard;
  replicated.replicate = mesh.replicate;
  torch::nn::Linear differs(4, 4 + world()->rank());
  differs->to(device());
  try {
    fully_shard(*differs, replicated);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("the model differs across ranks"));
    EXPECT_THAT(e.what(), HasSubstr("of '" + mesh.replicate->name() + "'"));
  }
}

}  // namespace
}  // namespace fsdp::testing
