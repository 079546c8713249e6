// Collectives on the MPI backend, checked against values every rank can compute.
#include "helpers.h"

namespace fsdp::testing {
namespace {

// Rank r's tensor: r * 100 + [0, n).
at::Tensor rank_values(int rank, int64_t n, at::ScalarType dtype = at::kFloat) {
  return (torch::arange(n, on_device()) + rank * 100).to(dtype);
}

TEST(Comm, AllGatherConcatenatesRanksInOrder) {
  auto c = world();
  auto out = torch::empty({3 * c->world_size()}, on_device());
  c->all_gather(out, rank_values(c->rank(), 3));
  for (int r = 0; r < c->world_size(); ++r)
    EXPECT_TRUE(torch::equal(out.narrow(0, 3 * r, 3), rank_values(r, 3)));
}

TEST(Comm, ReduceScatterSumAndAverage) {
  auto c = world();
  const int w = c->world_size();
  auto input = rank_values(c->rank(), 2 * w);
  at::Tensor sum = torch::zeros({2 * w}, on_device());
  for (int r = 0; r < w; ++r) sum += rank_values(r, 2 * w);
  auto out = torch::empty({2}, on_device());
  c->reduce_scatter(out, input, ReduceOp::Sum);
  EXPECT_TRUE(torch::allclose(out, sum.narrow(0, 2 * c->rank(), 2)));
  c->reduce_scatter(out, input, ReduceOp::Avg);
  EXPECT_TRUE(torch::allclose(out, sum.narrow(0, 2 * c->rank(), 2) / w));
}

TEST(Comm, Bf16ReductionsAreComputedInFloat) {
  auto c = world();
  auto t = torch::full({4}, 1.5, on_device(torch::kBFloat16));
  c->all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(t.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(t, torch::full({4}, 1.5 * c->world_size(), on_device(torch::kBFloat16))));
  auto out = torch::empty({1}, on_device(torch::kBFloat16));
  c->reduce_scatter(out, torch::full({c->world_size()}, 3.0, on_device(torch::kBFloat16)), ReduceOp::Avg);
  EXPECT_EQ(out.item<float>(), 3.0f);
}

TEST(Comm, AllReduceBroadcastBarrier) {
  auto c = world();
  auto t = torch::full({5}, double(c->rank() + 1), on_device(torch::kDouble));
  c->all_reduce(t, ReduceOp::Avg);
  EXPECT_DOUBLE_EQ(t[0].item<double>(), (c->world_size() + 1) / 2.0);
  auto b = torch::full({3}, c->rank(), on_device(torch::kLong));
  c->broadcast(b, c->world_size() - 1);
  EXPECT_TRUE(torch::equal(b, torch::full({3}, c->world_size() - 1, on_device(torch::kLong))));
  c->barrier();
}

TEST(Comm, CoalescedCollectives) {
  auto c = world();
  const int w = c->world_size();
  std::vector<at::Tensor> outs = {torch::empty({2 * w}, on_device()), torch::empty({5 * w}, on_device(torch::kBFloat16))};
  c->all_gather_coalesced(outs, {rank_values(c->rank(), 2), rank_values(c->rank(), 5, torch::kBFloat16)});
  EXPECT_TRUE(torch::equal(outs[0].narrow(0, 2 * (w - 1), 2), rank_values(w - 1, 2)));
  EXPECT_TRUE(torch::equal(outs[1].narrow(0, 0, 5), rank_values(0, 5, torch::kBFloat16)));
  std::vector<at::Tensor> reduced = {torch::empty({1}, on_device()), torch::empty({2}, on_device())};
  c->reduce_scatter_coalesced(reduced, {torch::ones({w}, on_device()), torch::full({2 * w}, 2.0, on_device())}, ReduceOp::Sum);
  EXPECT_EQ(reduced[0].item<float>(), float(w));
  EXPECT_TRUE(torch::equal(reduced[1], torch::full({2}, 2.0 * w, on_device())));
}

// Outputs are poisoned first, so an element a backend leaves unwritten shows.
TEST(Comm, OddSizesAreWrittenCompletely) {
  auto c = world();
  const int w = c->world_size();
  for (int64_t n : {1, 7, 1025, 7753}) {
    auto input = rank_values(c->rank(), n * w);
    at::Tensor sum = torch::zeros({n * w}, on_device());
    for (int r = 0; r < w; ++r) sum += rank_values(r, n * w);
    auto out = torch::full({n}, NAN, on_device());
    c->reduce_scatter(out, input, ReduceOp::Avg);
    EXPECT_TRUE(torch::allclose(out, sum.narrow(0, n * c->rank(), n) / w)) << n << " elements";
    auto gathered = torch::full({n * w}, NAN, on_device());
    c->all_gather(gathered, rank_values(c->rank(), n));
    for (int r = 0; r < w; ++r)
      EXPECT_TRUE(torch::equal(gathered.narrow(0, n * r, n), rank_values(r, n))) << n << " elements";
  }
}

TEST(Comm, WrongDeviceOrSizeIsRejectedBeforeCommunicating) {
  auto c = world();
  auto meta = torch::empty({4}, torch::Device(torch::kMeta));
  try {
    c->all_reduce(meta, ReduceOp::Sum);
    FAIL() << "expected CollectiveError";
  } catch (const CollectiveError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr(std::string("is a meta tensor, but the ") + c->backend() +
                                               " backend moves " + (device().is_cpu() ? "cpu" : "cuda")));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("rank " + std::to_string(c->rank()) + " of communicator 'world'"));
  }
  EXPECT_THROW(c->all_gather(torch::empty({3 * c->world_size() + 1}, on_device()), torch::empty({3}, on_device())), CollectiveError);
  EXPECT_THROW(c->all_reduce(torch::empty({4, 4}, on_device()).t(), ReduceOp::Sum), CollectiveError);
}

}  // namespace
}  // namespace fsdp::testing
