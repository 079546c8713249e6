// What fully_shard does to a module, and the errors it gives for bad input.
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "helpers.h"
#include "runtime/group_state.h"
#include "fsdp/memory_stats.h"
#include "shard/trace.h"

namespace fsdp::testing {
namespace {

template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected an error containing: " << needle;
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr(needle));
  }
}

TEST(Api, ParametersBecomeTheirShardsInPlace) {
  auto m = seeded_llama(tiny_llama());
  std::vector<const void*> impls;
  std::vector<at::Tensor> originals;
  for (auto& p : m->parameters()) {
    impls.push_back(p.unsafeGetTensorImpl());
    originals.push_back(p.detach().clone());
  }
  shard_blocks_and_root(m);
  const int w = world()->world_size(), r = world()->rank();
  auto params = m->named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i].value();
    EXPECT_EQ(p.unsafeGetTensorImpl(), impls[i]) << params[i].key() << " is the same object";
    const int64_t rows = originals[i].size(0), shard = (rows + w - 1) / w;
    const int64_t local = std::clamp<int64_t>(rows - r * shard, 0, shard);
    EXPECT_EQ(p.size(0), local) << params[i].key();
    EXPECT_TRUE(torch::equal(p, originals[i].narrow(0, std::min(r * shard, rows), local)));
    EXPECT_TRUE(torch::equal(full_parameter(*m, params[i].key()), originals[i]));
  }
}

// A deferred model holds one element per parameter until it is sharded; after reset_parameters
// its full weights equal those of the whole model built in one process: bit for bit, on every
// rank count the suite runs (1-4, uneven shards included).
TEST(Api, DeferredModelInitialisesAsTheWholeModelOnAnyRankCount) {
  auto c = tiny_llama();
  c.seed = 5;
  TestLlama deferred(c, TestPlacement{device(), /*deferred=*/true});
  for (const auto& p : deferred->parameters()) EXPECT_EQ(p.storage().nbytes(), sizeof(float));
  expect_error([&] { deferred->reset_parameters(); }, "must be sharded before it is filled");
  shard_blocks_and_root(deferred);
  deferred->reset_parameters();
  const auto whole = seeded_llama(tiny_llama(), 5);
  const auto want = whole->named_parameters();
  for (const auto& [name, full] : full_state_dict(*deferred)) {
    if (!want.contains(name)) continue;  // buffers
    EXPECT_TRUE(torch::equal(full, want[name])) << name;
  }
  EXPECT_EQ(want.size(), deferred->named_parameters().size());
}

TEST(Api, AfterAStepNoUnshardedMemoryRemains) {
  auto m = seeded_llama(tiny_llama());
  shard_blocks_and_root(m);
  auto tokens = torch::randint(0, 64, {2, 9}, on_device(torch::kLong));
  auto logits = fsdp::forward(m, tokens.narrow(1, 0, 8));
  // Between forward and backward only the root keeps its full parameters.
  EXPECT_TRUE(state_of(*m)->params().is_unsharded());
  EXPECT_GT(state_of(*m)->params().unsharded_bytes(), 0u);
  for (auto& b : m->blocks) EXPECT_EQ(state_of(*b)->params().unsharded_bytes(), 0u);
  torch::nn::functional::cross_entropy(logits.reshape({-1, 64}), tokens.narrow(1, 1, 8).reshape({-1})).backward();
  for (torch::nn::Module* module : std::vector<torch::nn::Module*>{m.ptr().get(), m->blocks[0].ptr().get(), m->blocks[1].ptr().get()}) {
    const auto& params = state_of(*module)->params();
    EXPECT_FALSE(params.is_unsharded());
    EXPECT_EQ(params.unsharded_bytes(), 0u);
    for (const auto& p : params.sharded()) {
      EXPECT_EQ(p.param.data_ptr(), p.shard.data_ptr()) << p.name << " holds its shard";
      ASSERT_TRUE(p.param.grad().defined()) << p.name;
      EXPECT_EQ(p.param.grad().sizes(), p.shard.sizes()) << p.name << " gradient is sharded";
    }
  }
}

// Each group frees its gathered parameters before its gradients' hand-off allocates the
// reduce-scatter input (FSDP2's order; the root's embedding and head once stayed gathered beside
// its input at the end of backward): at the hand-off's start the group's unsharded bytes less are
// allocated than at its backward's end: exactly on CPU (host memory counted), on GPUs as the
// caching allocator counts them, its block rounded up to 512 bytes. Without prefetch no
// all-gather comes between.
TEST(Api, EachGroupFreesItsParametersBeforeItsGradientsAreHandedOff) {
  count_host_allocations();
  const RuntimeOptions defaults = runtime_options();
  RuntimeOptions o = defaults;
  o.prefetch_depth = 0;
  set_runtime_options(o);
  auto m = seeded_llama(tiny_llama());
  shard_blocks_and_root(m);
  Trace::get().start(device(), /*with_memory=*/true);
  next_token_backward(m);
  const Trace::Recording recording = Trace::get().finish();
  set_runtime_options(defaults);
  const auto span = [&](const std::string& name) {
    for (const auto& s : recording.spans)
      if (s.name == name) return s;
    ADD_FAILURE() << "no span '" << name << "'";
    return Trace::FinishedSpan{};
  };
  const auto allocated = [&](int mark) { return mark < 0 ? int64_t{-1} : recording.marks.at(mark).allocated; };
  for (torch::nn::Module* module : std::vector<torch::nn::Module*>{m.ptr().get(), m->blocks[0].ptr().get(), m->blocks[1].ptr().get()}) {
    const GroupParams& params = state_of(*module)->params();
    const auto backward = span("backward " + params.label()), hand_off = span("hand-off " + params.label());
    const int64_t freed = allocated(backward.end_mark) - allocated(hand_off.start_mark);
    const auto unsharded = static_cast<int64_t>(params.unsharded_size_bytes());
    EXPECT_GE(freed, unsharded) << params.label();
    EXPECT_LT(freed, unsharded + (device().is_cuda() ? 512 : 1)) << params.label();
  }
}

// Parameters of two dtypes in one group, gathered in a common param_dtype (the copy-in casts each
// shard into it): each keeps its dtype, and the output and gradients are the unsharded module's.
struct TwoDtypes : torch::nn::Module {
  at::Tensor weight, scale;
  TwoDtypes() {
    weight = register_parameter("weight", torch::randn({7, 3}, on_device(torch::kFloat)));
    scale = register_parameter("scale", torch::randn({7}, on_device(torch::kDouble)));
  }
  at::Tensor forward(const at::Tensor& x) { return torch::mv(weight, x) * scale; }
};

TEST(Api, ParametersOfTwoDtypesGatherInTheComputeDtype) {
  torch::manual_seed(3);
  auto sharded = std::make_shared<TwoDtypes>(), plain = std::make_shared<TwoDtypes>();
  plain->weight.data().copy_(sharded->weight), plain->scale.data().copy_(sharded->scale);
  ShardOptions options;
  options.mixed_precision.param_dtype = at::kFloat;
  fully_shard(sharded, options);
  EXPECT_EQ(sharded->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(sharded->scale.scalar_type(), at::kDouble);
  const auto x = torch::randn({3}, on_device(torch::kFloat));
  const auto got = fsdp::forward(sharded, x);
  const auto want = torch::mv(plain->weight, x) * plain->scale.to(torch::kFloat);
  EXPECT_TRUE(torch::allclose(got, want)) << got << want;
  got.sum().backward();
  want.sum().backward();
  const int w = world()->world_size(), r = world()->rank();
  const auto own_rows = [&](const at::Tensor& full) {  // this rank's rows, as in the first test
    const int64_t rows = full.size(0), shard = (rows + w - 1) / w;
    return full.narrow(0, std::min(r * shard, rows), std::clamp<int64_t>(rows - r * shard, 0, shard));
  };
  EXPECT_TRUE(torch::allclose(sharded->weight.grad(), own_rows(plain->weight.grad())));
  // The float64 parameter's gradient was computed in float32: float32's rounding.
  EXPECT_TRUE(torch::allclose(sharded->scale.grad(), own_rows(plain->scale.grad()), 1e-5, 1e-6));
}

// Where the gradients' memory lies after backward. Several ranks: each group's sharded gradients
// are views of its one reduce-scatter output. One rank: each parameter's gradient is a buffer of its
// own, which the allocator can fit where a block's activations were (GroupParams::
// reduces_each_in_place; the 3B's reserved memory depends on it).
TEST(Api, ShardedGradientsLieInOneBufferPerGroupOrOnOneRankEachInItsOwn) {
  auto m = seeded_llama(tiny_llama());
  shard_blocks_and_root(m);
  next_token_backward(m);
  std::set<const void*> buffers;
  size_t grads = 0;
  for (const auto& p : m->parameters()) {
    if (!p.grad().defined() || p.grad().numel() == 0) continue;  // a rank may hold no rows of a parameter
    ++grads;
    buffers.insert(p.grad().storage().data());
    if (world()->world_size() == 1) EXPECT_EQ(p.grad().storage().nbytes(), p.grad().nbytes());
  }
  ASSERT_GT(grads, 0u);
  const size_t groups = m->blocks.size() + 1;
  EXPECT_EQ(buffers.size(), world()->world_size() == 1 ? grads : groups);
}

// keep_low_precision_grads: the sharded gradients stay in the reduce dtype, holding exactly the
// values that the default casts to the parameters' float32 (the cast is the only difference);
// their global norm is the same sum of the same squares, in float32 (to its rounding).
TEST(Api, KeepLowPrecisionGradsLeavesTheShardedGradientsInTheReduceDtype) {
  std::vector<double> norms;
  const auto gradients = [&](bool keep) {
    auto m = seeded_llama(tiny_llama());
    ShardOptions o;
    o.mixed_precision.param_dtype = o.mixed_precision.reduce_dtype = at::kBFloat16;
    o.mixed_precision.keep_low_precision_grads = keep;
    shard_blocks_and_root(m, o);
    torch::manual_seed(5);
    next_token_backward(m);
    norms.push_back(grad_norm(m->named_parameters().pairs()).item<double>());
    std::vector<at::Tensor> out;
    for (const auto& p : m->parameters()) out.push_back(p.grad());
    return out;
  };
  const auto kept = gradients(true), cast = gradients(false);
  EXPECT_NEAR(norms[0], norms[1], 1e-6 * norms[1]);
  ASSERT_EQ(kept.size(), cast.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    ASSERT_TRUE(kept[i].defined() && cast[i].defined()) << "parameter " << i;
    EXPECT_EQ(kept[i].scalar_type(), at::kBFloat16) << "parameter " << i;
    EXPECT_EQ(cast[i].scalar_type(), at::kFloat) << "parameter " << i;
    EXPECT_TRUE(torch::equal(kept[i].to(at::kFloat), cast[i])) << "parameter " << i;
  }
}

// The planner's count of the sharded gradients' bytes (GroupMemory::sharded_grad_bytes, through
// group_shapes) against the memory they hold after backward: gradients that alias the
// reduce-scatter's output (float32 throughout; bf16 kept) and cast copies of it (reduced in bf16,
// kept in float32). Every dimension divides by each rank count tested, so nothing is padded.
TEST(Api, ShardedGradientBytesAreCountedAsAllocated) {
  TestLlamaConfig c = tiny_llama();
  c.vocab = 48, c.dim = 24, c.ffn = 48;  // rows of 48, 24 and 96 (QKV: 24 + 2 x 12)
  struct Case {
    std::optional<at::ScalarType> dtype;  // param and reduce
    bool keep_low_precision_grads;
  };
  for (const Case& k : {Case{std::nullopt, false}, Case{at::kBFloat16, false}, Case{at::kBFloat16, true}}) {
    auto m = seeded_llama(c);
    ShardOptions o;
    o.mixed_precision.param_dtype = o.mixed_precision.reduce_dtype = k.dtype;
    o.mixed_precision.keep_low_precision_grads = k.keep_low_precision_grads;
    shard_blocks_and_root(m, o);
    next_token_backward(m);
    int64_t counted = 0;
    for (const auto& shape : group_shapes(PlanningRoot(*m))) counted += shape.memory.sharded_grad_bytes;
    std::map<const void*, int64_t> held;  // by storage
    for (const auto& p : m->parameters())
      if (p.grad().defined()) held[p.grad().storage().data()] = static_cast<int64_t>(p.grad().storage().nbytes());
    int64_t allocated = 0;
    for (const auto& [data, bytes] : held) allocated += bytes;
    EXPECT_EQ(counted, allocated) << (k.dtype ? "bf16" : "float32") << (k.keep_low_precision_grads ? ", kept" : "");
  }
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// One step of three groups: a forward, a backward and a hand-off span per group, an
// all-gather per group in forward and per block in backward (the root stays
// gathered), a reduce-scatter per group, an optimizer step per group (stepped in
// backward); six tracks named (all-reduce: HSDP only; the host's waits: on GPUs). Each span says
// when the host issued it, and each device span's issue is an instant on the host track.
TEST(Api, TraceHasComputeAllGatherAndReduceScatterSpans) {
  auto m = seeded_llama(tiny_llama());
  shard_blocks_and_root(m);
  set_step_in_backward(m, [](const std::vector<at::Tensor>&) {});
  start_trace();
  next_token_backward(m);
  const std::string path = ::testing::TempDir() + "fsdp_trace_" + std::to_string(world()->rank()) + ".json";
  write_trace(path);
  std::ifstream in(path);
  const std::string json((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(json.rfind("{\"traceEvents\":[", 0), 0u);
  EXPECT_EQ(count(json, "\"name\":\"forward #"), 3u);
  EXPECT_EQ(count(json, "\"name\":\"backward #"), 3u);
  EXPECT_EQ(count(json, "\"name\":\"hand-off #"), 3u);
  EXPECT_EQ(count(json, "\"name\":\"all-gather #"), 5u);
  EXPECT_EQ(count(json, "\"name\":\"reduce-scatter #"), 3u);
  EXPECT_EQ(count(json, "\"name\":\"step #"), 3u);
  EXPECT_EQ(count(json, "\"tid\":4,"), 4u);  // the host-step track's name and its three spans
  EXPECT_EQ(count(json, "\"thread_name\""), 6u);  // and the all-reduce and host tracks
  EXPECT_EQ(count(json, "\"issued_us\":"), 20u);  // every span
  EXPECT_EQ(count(json, "\"ph\":\"i\""), 17u);  // the device spans' issues: all but the host steps
  EXPECT_EQ(count(json, "\"name\":\"issue all-gather #"), 5u);
}

// Prefetches are issued in execution order on every rank (a regression: they
// once followed the registry's address order, so ranks issued equal-sized
// all-gathers in different orders and silently swapped blocks' weights).
TEST(Api, AllGathersFollowTheExecutionOrder) {
  const RuntimeOptions defaults = runtime_options();
  RuntimeOptions o = defaults;
  o.prefetch_depth = 3;
  set_runtime_options(o);
  auto c = tiny_llama();
  c.n_layers = 8;
  auto m = seeded_llama(c);
  shard_blocks_and_root(m);  // groups: the blocks first, the root last
  const int first = std::stoi(state_of(*m->blocks[0])->params().label().substr(1));  // "#<id> <module>"
  next_token_backward(m);  // records the order
  start_trace();
  next_token_backward(m);
  const std::string path = ::testing::TempDir() + "fsdp_order_" + std::to_string(world()->rank()) + ".json";
  write_trace(path);
  set_runtime_options(defaults);
  std::ifstream in(path);
  const std::string json((std::istreambuf_iterator<char>(in)), {});
  std::vector<int> gathered;
  const std::string tag = "\"name\":\"all-gather #";
  for (size_t at = json.find(tag); at != std::string::npos; at = json.find(tag, at + 1))
    gathered.push_back(std::stoi(json.substr(at + tag.size())) - first);
  // Forward: the root, then the blocks in order; backward (the root stays
  // gathered): the blocks in reverse.
  EXPECT_THAT(gathered, ::testing::ElementsAre(8, 0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0));
}

TEST(Api, ShardingAModuleTwiceIsAnError) {
  auto m = seeded_llama(tiny_llama());
  fully_shard(m->blocks[0]);
  expect_error([&] { fully_shard(m->blocks[0]); }, "already sharded: call fully_shard once per module");
}

TEST(Api, TopDownOrderIsAnError) {
  auto m = seeded_llama(tiny_llama());
  fully_shard(m);
  expect_error([&] { fully_shard(m->blocks[0]); }, "Apply fully_shard bottom-up");
}

// A head that holds the embedding's weight tensor as its own parameter.
class SharedHeadImpl : public torch::nn::Module {
 public:
  explicit SharedHeadImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor forward(const at::Tensor& x) { return torch::matmul(x, weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(SharedHead);

TEST(Api, WeightTiedAcrossGroupsIsAnError) {
  auto root = std::make_shared<torch::nn::Module>();
  auto emb = root->register_module("emb", torch::nn::Embedding(8, 4));
  auto head = root->register_module("head", SharedHead(emb->weight));
  root->to(device());
  fully_shard(head);
  expect_error([&] { fully_shard(*root); }, "shard modules that share a weight");
}

TEST(Api, ModelThatDiffersAcrossRanksIsAnError) {
  if (world()->world_size() == 1) GTEST_SKIP() << "needs two ranks";
  auto c = tiny_llama();
  c.ffn = 48 + 8 * world()->rank();
  auto m = seeded_llama(c);
  expect_error([&] { fully_shard(m->blocks[0]); }, "the model differs across ranks");
}

TEST(Api, ModuleNotOwnedBySharedPtrIsAnError) {
  torch::nn::LinearImpl on_stack(2, 2);
  expect_error([&] { fully_shard(on_stack); }, "must be owned by a shared_ptr");
}

}  // namespace
}  // namespace fsdp::testing
