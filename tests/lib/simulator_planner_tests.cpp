// The schedule simulator and the planner on hand-made cost models whose answers are worked out
// by hand in the comments (no device: times and bytes are the model's own numbers).
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "fsdp/plan/measured_step.h"
#include "fsdp/plan/planner.h"
#include "fsdp/plan/projection.h"
#include "fsdp/plan/simulator.h"

namespace {

using namespace fsdp::plan;

// Two groups A, B: 100 bytes of parameters, 50 of reduce-scatter input (gradients), 30 saved (5 when recomputed),
// 40 above the start inside a forward, 20 inside a backward; all-gather and reduce-scatter
// 0.5 ms, forward 1 ms, backward 2 ms; 1000 fixed bytes, 1 ms of optimizer.
CostModel two_groups() {
  CostModel m;
  for (const char* name : {"A", "B"}) {
    GroupCost g;
    g.name = name;
    g.memory.param_bytes = 100, g.memory.reduce_input_bytes = 50, g.saved_bytes = 30, g.recompute_saved_bytes = 5;
    g.forward_peak_bytes = 40, g.backward_peak_bytes = 20;
    g.allgather_ms = 0.5, g.reduce_scatter_ms = 0.5, g.forward_ms = 1, g.backward_ms = 2;
    m.groups.push_back(g);
  }
  m.fixed_bytes = 1000, m.fixed_ms = 1;
  return m;
}

// The two groups under the default schedule with these changes.
Prediction two_groups_with(int depth, std::vector<bool> recompute = {false, false},
                           std::vector<bool> reshard_after_forward = {true, true}) {
  Schedule s = default_schedule(2);
  s.runtime.prefetch_depth = depth;
  s.recompute = std::move(recompute);
  s.reshard_after_forward = std::move(reshard_after_forward);
  return simulate(two_groups(), s);
}

// Without prefetch every all-gather waits for the compute before it:
//   AG A 0-0.5, fwd A 0.5-1.5, AG B 1.5-2, fwd B 2-3, AG B 3-3.5, bwd B 3.5-5.5 (RS B 5.5-6),
//   AG A 5.5-6, bwd A 6-8, RS A 8-8.5, optimizer 8.5-9.5.
// Memory: after the forward 1000 + 30 + 30; in B's backward its parameters come back (1160) and
// its gradients replace its activations (1080 after its reshard); A's backward adds its
// parameters (1180) and 20 working bytes: the peak, 1200, with B's gradients still in flight.
TEST(Simulator, StepTimeAndPeakOfAHandWorkedSchedule) {
  const Prediction p = two_groups_with(0);
  EXPECT_DOUBLE_EQ(p.step_ms, 9.5);
  EXPECT_EQ(p.peak_bytes, 1200);
  EXPECT_EQ(p.peak_during, "backward of A");
  int64_t sum = 0;
  for (const auto& b : p.live_at_peak) sum += b.bytes;
  EXPECT_EQ(sum, p.peak_bytes);
  ASSERT_EQ(p.live_at_peak.size(), 5u);  // largest first
  EXPECT_EQ(p.live_at_peak[0].what, "fixed (shards, optimizer state, workspaces)");
  EXPECT_EQ(p.live_at_peak[1].what, "parameters of A");
  EXPECT_EQ(p.live_at_peak[2].what, "reduce-scatter input of B");
  EXPECT_EQ(p.timeline.back().second, 1000);  // everything but the fixed bytes freed
}

// Gradient accumulation, two passes of the schedule above with 10 bytes of sharded gradients a
// group: the first pass as before (8.5 ms) but for the sharded gradients, kept from each
// reduce-scatter on; its peak is in A's backward as above with B's result beside it: 1210 (A
// reshards before its own input comes). The second pass starts with both groups' sharded
// gradients (1020) and adds a 10-byte reduce-scatter output per group until its end: in A's
// backward 1210 + 20 = 1230. One optimizer step: 2 x 8.5 + 1.
TEST(Simulator, GradientAccumulationRepeatsThePassesWithTheShardedGradientsHeld) {
  CostModel m = two_groups();
  for (auto& g : m.groups) g.memory.sharded_grad_bytes = 10;
  m.micro_batches = 2;
  Schedule s = default_schedule(2);
  s.runtime.prefetch_depth = 0;
  const Prediction p = simulate(m, s);
  EXPECT_DOUBLE_EQ(p.step_ms, 18);
  EXPECT_EQ(p.peak_bytes, 1230);
  EXPECT_EQ(p.peak_during, "backward of A");
  EXPECT_EQ(p.timeline.back().second, 1020);  // the fixed bytes and the sharded gradients
  m.micro_batches = 0;
  EXPECT_THROW(simulate(m, s), std::invalid_argument);
}

// The same two passes without communication before the last, 60 bytes of unsynced sums a group:
// the first pass has no reduce-scatter (8 ms: bwd A ends at 8) and leaves both sums (1120); the
// second runs as one step (8.5 ms) with each sum held until its group's reduce-scatter; the peak
// is in B's backward: 1000 + both sums 120 + B's parameters 100 + both groups' activations 60 +
// 20 working = 1300 (B's reduce-scatter input, 50, then takes the place of its activations and
// working memory: the runtime frees the sums before it allocates the result).
TEST(Simulator, GradientAccumulationWithoutCommunicationHoldsUnshardedSums) {
  CostModel m = two_groups();
  for (auto& g : m.groups) g.memory.sharded_grad_bytes = 10, g.memory.unsynced_grad_bytes = 60;
  m.micro_batches = 2;
  m.reduce_every_micro_batch = false;
  Schedule s = default_schedule(2);
  s.runtime.prefetch_depth = 0;
  const Prediction p = simulate(m, s);
  EXPECT_DOUBLE_EQ(p.step_ms, 8 + 8.5 + 1);
  EXPECT_EQ(p.peak_bytes, 1300);
  EXPECT_EQ(p.peak_during, "backward of B");
  EXPECT_EQ(p.timeline.back().second, 1020);
}

// A hand-off of 0.25 ms a group (the copy into the reduce-scatter input) runs on the compute
// stream between a group's backward and its reduce-scatter: bwd B 3.5-5.5, hand-off B 5.5-5.75, RS
// B 5.75-6.25; A's all-gather waits for the compute issued before it: 5.75-6.25, bwd A 6.25-8.25,
// hand-off A -8.5, RS A -9, optimizer -10 (9.5 without). Passes without communication hand
// nothing off to a reduce-scatter: with the unsynced pass first, 8 + (8.5 + 0.5) + 1.
TEST(Simulator, HandOffsRunBetweenABackwardAndItsReduceScatter) {
  CostModel m = two_groups();
  for (auto& g : m.groups) g.handoff_ms = 0.25;
  Schedule s = default_schedule(2);
  s.runtime.prefetch_depth = 0;
  EXPECT_DOUBLE_EQ(simulate(m, s).step_ms, 10.0);
  m.micro_batches = 2;
  m.reduce_every_micro_batch = false;
  EXPECT_DOUBLE_EQ(simulate(m, s).step_ms, 18.0);
}

// Prefetch depth 1: B's all-gather (0.5-1) hides behind A's forward and A's (3-3.5) behind B's
// backward: fwd A 0.5-1.5, fwd B 1.5-2.5, AG B 2.5-3, bwd B 3-5, bwd A 5-7, RS A 7-7.5, then the
// optimizer: 8.5 ms. The price is memory: in B's backward A's parameters are already there, next
// to B's and both groups' activations: 1000 + 30 + 30 + 100 + 100 + 20 working = 1280.
TEST(Simulator, PrefetchHidesAllGathersAndHoldsOneMoreGroup) {
  const Prediction p = two_groups_with(1);
  EXPECT_DOUBLE_EQ(p.step_ms, 8.5);
  EXPECT_EQ(p.peak_bytes, 1280);
  EXPECT_EQ(p.peak_during, "backward of B");
}

// A short group (B: forward 0.2 ms, backward 0.4) before a heavy one (C: all-gather 2 ms), as a
// small block before a large output head. Depth 1 issues C's all-gather at B's start, after A's
// forward (1.5), so C waits for it: AG A 0-0.5, AG B 0.5-1, fwd A 0.5-1.5, fwd B 1.5-1.7, AG C
// 1.5-3.5, fwd C 3.5-4.5; backward AG C 4.5-6.5, AG B 6.5-7, bwd C 6.5-8.5, AG A (at B's start)
// 8.5-9, bwd B 8.5-8.9, bwd A 9-11, RS A 11-11.5, optimizer: 12.5 ms. A's own depth 2 issues C's
// at A's start, right after B's (1-3): fwd C 3-4 and everything after 0.5 ms earlier: 12 ms.
// Depth 2 everywhere also issues A's backward all-gather at C's (6.5-7), so bwd A follows bwd B
// at once (8.4): 11.9 ms, but it holds one more group's parameters in backward.
CostModel short_before_heavy() {
  CostModel m = two_groups();
  m.groups[1].forward_ms = 0.2, m.groups[1].backward_ms = 0.4;
  GroupCost heavy = two_groups().groups[0];
  heavy.name = "C", heavy.allgather_ms = 2;
  m.groups.push_back(heavy);
  return m;
}

TEST(Simulator, AGroupsOwnPrefetchDepthStartsLaterAllGathersAtItsStart) {
  const CostModel m = short_before_heavy();
  Schedule uniform = default_schedule(3), deeper = uniform, everywhere = uniform;
  deeper.prefetch_depth[0] = 2;
  everywhere.runtime.prefetch_depth = 2;
  const Prediction u = simulate(m, uniform), d = simulate(m, deeper), e = simulate(m, everywhere);
  EXPECT_DOUBLE_EQ(u.step_ms, 12.5);
  EXPECT_DOUBLE_EQ(d.step_ms, 12.0);
  EXPECT_DOUBLE_EQ(e.step_ms, 11.9);
  EXPECT_GT(e.peak_bytes, d.peak_bytes);
  EXPECT_EQ(deeper.prefetch_depth_of(0), 2);
  EXPECT_EQ(deeper.prefetch_depth_of(1), 1);
  Schedule none = uniform;
  none.prefetch_depth.clear();  // an empty vector: the runtime's depth everywhere
  EXPECT_DOUBLE_EQ(simulate(m, none).step_ms, u.step_ms);
  none.prefetch_depth = {2, -1};
  EXPECT_THROW(simulate(m, none), std::invalid_argument);
  none.prefetch_depth = {-2, -1, -1};
  EXPECT_THROW(simulate(m, none), std::invalid_argument);
}

// Checkpointing A keeps 5 bytes instead of 30 through the forward and recomputes it (1 ms) in
// backward: AG A 5.5-6, recompute 6-7, bwd A 7-9, RS A 9-9.5, optimizer: 10.5 ms. Its recompute
// runs while B's gradients are in flight: 1000 + 50 (grads B) + 5 + 100 (params A) + 40 = 1195,
// then 30 recomputed and 20 working: 1205, more than without recomputation (1200).
TEST(Simulator, CheckpointingTradesRecomputeTimeForSavedBytes) {
  const Prediction p = two_groups_with(0, {true, false});
  EXPECT_DOUBLE_EQ(p.step_ms, 10.5);
  EXPECT_EQ(p.peak_bytes, 1205);
  Schedule s = default_schedule(2);
  s.recompute = {true, true};
  auto model = two_groups();
  model.groups[1].recomputable = false;
  EXPECT_THROW(simulate(model, s), std::invalid_argument);
  EXPECT_THROW(simulate(two_groups(), default_schedule(3)), std::invalid_argument);
}

// Contention at prefetch depth 1: collectives beside compute take twice as long, and compute
// loses 0.5 ms per ms of collective beside it. AG A 0-0.5 (alone), AG B 0.5-1.5 (prefetched,
// stretched); fwd A 0.5-1.5 plus 0.5 x 1 ms of AG B beside it: 0.5-2; fwd B 2-3. AG B 3-3.5
// (alone: nothing computes), AG A 3.5-4.5 (prefetched); bwd B 3.5-5.5 plus 0.5: -6; RS B 6-7
// (stretched: A's backward follows), bwd A 6-8 plus 0.5: -8.5; RS A 8.5-9 (the last), optimizer: 10.
TEST(Simulator, ContentionSlowsCollectivesAndTheComputeBesideThem) {
  Schedule s = default_schedule(2);
  CostModel m = two_groups();
  m.contention = {2.0, 2.0, 0.5};
  EXPECT_DOUBLE_EQ(simulate(m, s).step_ms, 10.0);
  EXPECT_DOUBLE_EQ(simulate(two_groups(), s).step_ms, 8.5);
  EXPECT_EQ(simulate(m, s).peak_bytes, simulate(two_groups(), s).peak_bytes);  // time only
}

// The calibration inverts the simulator: the step above, recorded span by span, gives back the
// contention it ran with (stretches from the spans beside compute; the slowdown by bisection,
// with the profiled step at prefetch 0 taking 9.75 ms, so fixed_ms stays 1).
TEST(Calibration, RecoversTheContentionOfARecordedStep) {
  std::vector<GroupShape> shapes(2);
  shapes[0].name = "A", shapes[0].label = "#1 A", shapes[1].name = "B", shapes[1].label = "#2 B";
  for (auto& shape : shapes) shape.recomputable = false;  // profiled and calibrated as worked out above
  RecordedStep step;
  step.spans = {{"all-gather #1 A", 0, 0.5},     {"all-gather #2 B", 0.5, 1.5}, {"forward #1 A", 0.5, 2},
                {"forward #2 B", 2, 3},          {"all-gather #2 B", 3, 3.5},   {"all-gather #1 A", 3.5, 4.5},
                {"backward #2 B", 3.5, 6},       {"reduce-scatter #2 B", 6, 7}, {"backward #1 A", 6, 8.5},
                {"reduce-scatter #1 A", 8.5, 9}};
  step.step_ms = 10;
  CostModel m = two_groups();
  m.profiled_step_ms = 9.75;
  calibrate_contention(m, shapes, step);
  EXPECT_DOUBLE_EQ(m.contention.allgather_stretch, 2.0);
  EXPECT_DOUBLE_EQ(m.contention.reduce_scatter_stretch, 2.0);
  EXPECT_NEAR(m.contention.compute_slowdown, 0.5, 1e-3);
  EXPECT_NEAR(m.fixed_ms, 1.0, 1e-3);
  EXPECT_EQ(calibration_schedule(shapes).runtime.prefetch_depth, 1);

  // A calibration step faster than even no contention explains: none is fitted.
  step.step_ms = 8;
  calibrate_contention(m, shapes, step);
  EXPECT_EQ(m.contention.compute_slowdown, 0.0);
  step.spans.clear();
  EXPECT_THROW(calibrate_contention(m, shapes, step), std::invalid_argument);
}

// A root R around one block B, recorded: R's own compute is what its spans hold beyond B's, its
// all-gather and its hand-off. Forward: R 0-10, B's all-gather 1-2, B 2-6: the embedding 2 - 0 - 1
// and the head 10 - 6, 5 ms. Backward: R 10-30, B's all-gather 13-14, B 14-24, B's hand-off 24-25:
// the head's 14 - 10 - 1 and the embedding's 30 - 24 - 1, 8 ms (B's hand-off is B's: 1 ms).
TEST(Measurement, TheRootsComputeLeavesOutTheBlocksHandOff) {
  std::vector<GroupShape> shapes(2);
  shapes[0].name = "R", shapes[0].label = "#1 R", shapes[0].encloses_later = true;
  shapes[1].name = "B", shapes[1].label = "#2 B";
  for (auto& shape : shapes) shape.recomputable = false;
  RecordedStep step;
  int mark = 1;  // marks[0] is the step's start; each span takes two more
  const auto span = [&](const char* name, double start, double end) {
    mark += 2;
    return RecordedSpan{name, start, end, start, end, mark - 2, mark - 1};
  };
  step.spans = {span("forward #1 R", 0, 10),  span("all-gather #2 B", 1, 2),  span("forward #2 B", 2, 6),
                span("backward #1 R", 10, 30), span("all-gather #2 B", 13, 14), span("backward #2 B", 14, 24),
                span("hand-off #2 B", 24, 25), span("reduce-scatter #2 B", 25, 26), span("hand-off #1 R", 30, 31)};
  step.marks.resize(mark + 1);
  step.step_ms = 40;
  const CostModel m = measure_cost_model(shapes, step);
  EXPECT_DOUBLE_EQ(m.groups[0].forward_ms, 5);
  EXPECT_DOUBLE_EQ(m.groups[0].backward_ms, 8);
  EXPECT_DOUBLE_EQ(m.groups[0].handoff_ms, 1);
  EXPECT_DOUBLE_EQ(m.groups[1].backward_ms, 10);
  EXPECT_DOUBLE_EQ(m.groups[1].handoff_ms, 1);
  EXPECT_DOUBLE_EQ(m.groups[1].handoff_cpu_ms, 1);
}

// Keeping B unsharded from forward to backward skips its second all-gather.
TEST(Simulator, KeepingAGroupUnshardedSkipsItsSecondAllGather) {
  // fwd B ends at 3 and bwd B starts at once (3-5); AG A 5-5.5, bwd A 5.5-7.5, RS A 7.5-8, +1.
  EXPECT_DOUBLE_EQ(two_groups_with(0, {false, false}, {true, false}).step_ms, 9.0);
}

// A root R (embedding and head around the blocks) enclosing one block B; 1000 fixed bytes, 1 ms
// for every compute, free communication, no prefetch. R: 100 bytes of parameters and of unsharded
// gradients, 200 of reduce-scatter input, 10 sharded, 20 saved; B: 50, 50, 100, 5, 30 (2 ms backward).
//   forward:  gather R (1100), gather B (1150), B saves 30 (1180), B reshards (1130), R's head
//             saves 20 (1150);
//   backward: R's head first: its activations go, its gradients come (1230); B gathered (1280),
//             its activations go and gradients come (1300), it reshards (1250), its reduce-scatter
//             input comes (1350), its gradients go and its shard comes (1305); R last: it reshards
//             (1205), input 200 (1405: the peak, B's reduce-scatter still in flight), its gradients
//             go (1305), its shard comes (1315).
// At the end only the fixed bytes and the shards remain: 1015. Time: B 0-1, head 1-2, head's
// backward 2-3, B's backward 3-5.
TEST(Simulator, RootComputesAfterTheBlocksAndReducesLast) {
  CostModel m;
  auto add = [&](const char* name, int64_t params, int64_t reduce_input, int64_t shard, int64_t saved, double bwd) {
    GroupCost g;
    g.name = name;
    g.memory.param_bytes = g.memory.grad_bytes = params, g.memory.reduce_input_bytes = reduce_input, g.memory.sharded_grad_bytes = shard;
    g.saved_bytes = g.recompute_saved_bytes = saved;
    g.forward_ms = 1, g.backward_ms = bwd;
    m.groups.push_back(g);
  };
  add("R", 100, 200, 10, 20, 1);
  add("B", 50, 100, 5, 30, 2);
  m.groups[0].encloses_later = true;
  m.groups[0].recomputable = false;
  m.fixed_bytes = 1000;
  Schedule s = default_schedule(2);
  s.runtime.prefetch_depth = 0;
  const Prediction p = simulate(m, s);
  EXPECT_EQ(p.peak_bytes, 1405);
  EXPECT_EQ(p.peak_during, "reduce-scatter of R");
  EXPECT_EQ(p.timeline.back().second, 1015);
  EXPECT_DOUBLE_EQ(p.step_ms, 5);
  m.groups[1].encloses_later = true;
  EXPECT_THROW(simulate(m, s), std::invalid_argument);  // only the first group can be a root
}

// Groups of `param_bytes` each (10 bytes is small for the 50-byte buckets below): all-gather and
// reduce-scatter 0.3 ms (0.5 for a large group), 0.2 ms of it latency; forward 1 ms, backward 2;
// reduce-scatter inputs half the parameters, nothing else; 1 ms of optimizer; no prefetch.
CostModel latency_bound(const std::vector<int64_t>& param_bytes) {
  CostModel m;
  for (size_t i = 0; i < param_bytes.size(); ++i) {
    GroupCost g;
    g.name = std::string(1, char('A' + i));
    g.memory.param_bytes = param_bytes[i], g.memory.reduce_input_bytes = param_bytes[i] / 2;
    g.allgather_ms = g.reduce_scatter_ms = param_bytes[i] > 10 ? 0.5 : 0.3;
    g.forward_ms = 1, g.backward_ms = 2;
    m.groups.push_back(g);
  }
  m.allgather_latency_ms = m.reduce_scatter_latency_ms = 0.2;
  m.fixed_ms = 1;
  return m;
}

Schedule buckets_of(size_t groups, int64_t bucket_bytes, int max_wait = 0) {
  Schedule s = default_schedule(groups);
  s.runtime.prefetch_depth = 0;
  s.runtime.bucket_mb = double(bucket_bytes) / (1024 * 1024);
  s.runtime.reduce_bucket_max_wait = max_wait;
  return s;
}

// Small A, C, D around a large B, in 50-byte buckets. Forward: A's all-gather takes C and D along
// (past B): 0.9 ms less two latencies, 0-0.5; fwd A 0.5-1.5, AG B 1.5-2, fwd B 2-3, C 3-4, D 4-5.
// Backward D, C, B, A: D's all-gather takes C and A, 5-5.5; bwd D 5.5-7.5 and C 7.5-9.5 leave
// their gradients in the bucket; AG B 9.5-10, bwd B 10-12, whose 100 bytes send the bucket: D, C
// and B in one reduce-scatter, 1.1 ms less two latencies, 12-12.7; bwd A 12-14, RS A 14-14.3,
// +1: 15.3 ms. The peak, 120 bytes, is at B's all-gather: in forward B's parameters 100 beside
// C's and D's 10 + 10 (gathered early), and again in backward beside A's 10 and D's and C's inputs
// 5 + 5 (each group reshards before its input comes). Apart: 0.3 ms more per all-gather and
// 16.1 ms (worked as above), and a peak of 110 in backward (A's parameters not there yet).
TEST(Simulator, BucketsGatherSmallGroupsPastLargeOnesAndSaveLatencies) {
  const CostModel m = latency_bound({10, 100, 10, 10});
  const Prediction bucketed = simulate(m, buckets_of(4, 50));
  EXPECT_DOUBLE_EQ(bucketed.step_ms, 15.3);
  EXPECT_EQ(bucketed.peak_bytes, 120);
  EXPECT_EQ(bucketed.peak_during, "all-gather of B");
  const Prediction apart = simulate(m, buckets_of(4, 0));
  EXPECT_DOUBLE_EQ(apart.step_ms, 16.1);
  EXPECT_EQ(apart.peak_bytes, 110);
  CostModel no_latency = m;
  no_latency.allgather_latency_ms = no_latency.reduce_scatter_latency_ms = 0;
  EXPECT_GT(simulate(no_latency, buckets_of(4, 50)).step_ms, bucketed.step_ms);
  EXPECT_THROW(simulate(m, buckets_of(4, 50, -1)), std::invalid_argument);
}

// Three small groups in one bucket: forward AG 0-0.5, fwd 0.5-3.5; backward AG 3.5-4, bwd C 4-6,
// B 6-8, A 8-10. Without a cap on the wait the three reduce-scatters go out after A's backward,
// 10-10.5, and the step takes 11.5 ms; with a wait of one group C and B go at B's end (8-8.4,
// beside A's backward) and A alone after it, 10-10.3: 11.3 ms.
TEST(Simulator, CappingTheBucketsWaitSendsGradientsBesideLaterCompute) {
  const CostModel m = latency_bound({10, 10, 10});
  EXPECT_DOUBLE_EQ(simulate(m, buckets_of(3, 50)).step_ms, 11.5);
  EXPECT_DOUBLE_EQ(simulate(m, buckets_of(3, 50, 1)).step_ms, 11.3);
}

// The fixed points of the frontier: every group that can be recomputed is (or none), and every
// group is resharded but the root, which encloses the others.
TEST(Schedules, UniformCheckpointsWhatCanBeAndKeepsOnlyTheRoot) {
  std::vector<GroupCost> groups(3);
  groups[0].encloses_later = true, groups[0].recomputable = false;
  groups[2].recomputable = false;
  const Schedule all = uniform_schedule(groups, true), none = uniform_schedule(groups, false);
  EXPECT_EQ(all.recompute, (std::vector<bool>{false, true, false}));
  EXPECT_EQ(none.recompute, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(all.reshard_after_forward, (std::vector<bool>{false, true, true}));
  EXPECT_EQ(all.runtime.prefetch_depth, default_schedule(3).runtime.prefetch_depth);
}

// A deep model with much activation memory: eight blocks of 1000 saved bytes (10 recomputed),
// 1 ms forward, 2 ms backward; communication hides behind compute.
CostModel deep() {
  CostModel m;
  for (int i = 0; i < 8; ++i) {
    GroupCost g;
    g.name = "blocks." + std::to_string(i);
    g.memory.param_bytes = 100, g.memory.reduce_input_bytes = 100, g.saved_bytes = 1000, g.recompute_saved_bytes = 10;
    g.forward_peak_bytes = 1200, g.backward_peak_bytes = 500;
    g.allgather_ms = 0.2, g.reduce_scatter_ms = 0.2, g.forward_ms = 1, g.backward_ms = 2;
    m.groups.push_back(g);
  }
  m.fixed_bytes = 5000;
  return m;
}

TEST(Planner, UnboundedBudgetTakesTheFastestWithoutCheckpointing) {
  const auto model = deep();
  const Plan plan = plan_schedule(model, int64_t(1) << 40);
  for (bool c : plan.chosen.schedule.recompute) EXPECT_FALSE(c);
  const Schedule none = default_schedule(8);
  EXPECT_LE(plan.chosen.prediction.step_ms, simulate(model, none).step_ms);
  ASSERT_EQ(plan.runners_up.size(), 3u);
  for (const auto& r : plan.runners_up) EXPECT_GE(r.prediction.step_ms, plan.chosen.prediction.step_ms);
}

TEST(Planner, TightBudgetCheckpointsJustEnoughAndTooSmallOneNamesTheLeastThatFits) {
  const auto model = deep();
  Schedule all = default_schedule(8);
  all.recompute.assign(8, true);
  const int64_t full_peak = simulate(model, default_schedule(8)).peak_bytes;
  const int64_t recomputed_peak = simulate(model, all).peak_bytes;
  ASSERT_LT(recomputed_peak, full_peak);
  // Halfway between the two peaks: some blocks recomputed, not all, under the usable budget,
  // and slower than no recomputation only by the recompute it chose.
  const int64_t budget = (full_peak + recomputed_peak) / 2;
  const Plan plan = plan_schedule(model, budget, 0.05);
  const auto& chosen = plan.chosen.schedule.recompute;
  const long k = std::count(chosen.begin(), chosen.end(), true);
  EXPECT_GT(k, 0);
  EXPECT_LT(k, 8);
  EXPECT_LE(plan.chosen.prediction.peak_bytes, plan.usable_bytes);
  EXPECT_EQ(plan.usable_bytes, int64_t(budget * 0.95));
  EXPECT_LT(plan.chosen.prediction.step_ms, simulate(model, all).step_ms);
  try {
    plan_schedule(model, 1000);
    FAIL() << "expected BudgetTooSmall";
  } catch (const BudgetTooSmall& e) {
    EXPECT_NE(std::string(e.what()).find("the smallest budget that fits is"), std::string::npos) << e.what();
    EXPECT_NO_THROW(plan_schedule(model, e.smallest_budget_bytes));  // the named budget is enough
    EXPECT_THROW(plan_schedule(model, e.smallest_budget_bytes - 64), BudgetTooSmall);
  }
}

// Twelve small groups whose collectives are mostly latency: the planner buckets them; without
// a latency to save it never tries.
TEST(Planner, BucketsGroupsWhenTheirCollectivesAreLatency) {
  CostModel m = latency_bound(std::vector<int64_t>(12, 10));
  for (auto& g : m.groups) g.forward_ms = 0.1, g.backward_ms = 0.2;
  const Plan plan = plan_schedule(m, int64_t(1) << 40);
  EXPECT_GT(plan.chosen.schedule.runtime.bucket_mb, 0);
  Schedule apart = plan.chosen.schedule;
  apart.runtime.bucket_mb = 0, apart.runtime.reduce_bucket_max_wait = 0;
  EXPECT_LT(plan.chosen.prediction.step_ms, simulate(m, apart).step_ms);
  m.allgather_latency_ms = m.reduce_scatter_latency_ms = 0;
  EXPECT_EQ(bucket_sizes_mb(m), std::vector<double>{0});
  EXPECT_EQ(plan_schedule(m, int64_t(1) << 40).chosen.schedule.runtime.bucket_mb, 0);
}

// With A's own depth 2's peak as the budget (depth 2 everywhere peaks higher): the planner's
// fastest uniform schedule that fits, deepened at A, and faster for it.
TEST(Planner, DeepensOneGroupsPrefetchWhereDepthEverywhereDoesNotFit) {
  const CostModel m = short_before_heavy();
  Schedule deeper = default_schedule(3), everywhere = deeper;
  deeper.prefetch_depth[0] = 2;
  everywhere.runtime.prefetch_depth = 2;
  const int64_t budget = simulate(m, deeper).peak_bytes;
  ASSERT_LT(budget, simulate(m, everywhere).peak_bytes);
  const Plan plan = plan_schedule(m, budget, 0);
  const Schedule& chosen = plan.chosen.schedule;
  EXPECT_LE(plan.chosen.prediction.peak_bytes, budget);
  EXPECT_EQ(chosen.prefetch_depth, (std::vector<int>{2, -1, -1}));
  Schedule uniform = chosen;
  uniform.prefetch_depth.assign(3, -1);
  EXPECT_LT(plan.chosen.prediction.step_ms, simulate(m, uniform).step_ms);
  EXPECT_NE(describe(chosen, m).find(", prefetch 1 (A 2), "), std::string::npos) << describe(chosen, m);
}

TEST(Planner, DescribeNamesTheChoices) {
  Schedule s = default_schedule(8);
  s.recompute[0] = s.recompute[1] = true;
  s.reshard_after_forward[7] = false;
  s.runtime.max_inflight_reduce_scatters = 0;
  EXPECT_EQ(describe(s, deep()),
            "recompute 2 of 8 (blocks.0, blocks.1), 1 kept unsharded (blocks.7), prefetch 1, in flight 2 "
            "all-gathers / unlimited reduce-scatters");
  for (size_t g = 2; g < 6; ++g) s.recompute[g] = true;  // more than four named: the first four, then "..."
  EXPECT_NE(describe(s, deep()).find("recompute 6 of 8 (blocks.0, blocks.1, blocks.2, blocks.3, ...), 1 kept"),
            std::string::npos) << describe(s, deep());
  s.runtime.bucket_mb = 1.5, s.runtime.reduce_bucket_max_wait = 2;
  EXPECT_NE(describe(s, deep()).find("reduce-scatters, buckets of 1.5 MiB waiting at most 2 groups"),
            std::string::npos);
}

// One group measured on 2 ranks: 200 MB gathered and reduced, each collective 1.5 ms of which
// 0.5 ms latency, so its ring moves 1/2 * 200 MB in 1 ms: 100 GB/s (1e8 bytes a ms). 100 bytes
// of sharded gradients; 1000 fixed bytes of which 600 sharded.
MeasuredCost measured_on_two() {
  MeasuredCost m;
  m.world = 2;
  GroupCost g;
  g.name = "blocks.0";
  g.memory.param_bytes = g.memory.reduce_input_bytes = 200'000'000;
  g.memory.sharded_grad_bytes = 100;
  g.allgather_ms = g.reduce_scatter_ms = 1.5;
  g.forward_ms = 10, g.backward_ms = 20;
  m.model.groups = {g};
  m.model.allgather_latency_ms = m.model.reduce_scatter_latency_ms = 0.5;
  m.model.fixed_bytes = 1000, m.model.fixed_ms = 1;
  m.sharded_fixed_bytes = 600;
  return m;
}

// 4 ranks of one host: 3/4 * 200 MB at 100 GB/s = 1.5 ms, latency 0.5 * 3 steps: 3 ms. The
// sharded state halves: gradients 50 bytes, fixed 400 + 300.
TEST(Projection, ARingOnOneHostKeepsItsBandwidthAndGrowsItsLatency) {
  const CostModel p = project(measured_on_two(), {4, 1}, Cluster{});
  EXPECT_DOUBLE_EQ(p.groups[0].allgather_ms, 3.0);
  EXPECT_DOUBLE_EQ(p.groups[0].reduce_scatter_ms, 3.0);
  EXPECT_DOUBLE_EQ(p.allgather_latency_ms, 1.5);
  EXPECT_EQ(p.groups[0].memory.sharded_grad_bytes, 50);
  EXPECT_EQ(p.groups[0].memory.param_bytes, 200'000'000);  // unsharded sizes stay
  EXPECT_EQ(p.fixed_bytes, 700);
  EXPECT_DOUBLE_EQ(p.groups[0].forward_ms, 10);  // per-GPU work stays
}

// 16 ranks over two hosts of 8: the ring is held to the network's 50 GB/s: 15/16 * 200 MB = 3.75
// ms, latency 0.5 * 15 = 7.5. As HSDP 2 x 8 each ring stays in its host (7/8 * 200 MB at 100 GB/s
// = 1.75 ms + 3.5) and the reduce-scatter adds the replicas' all-reduce of a 25 MB shard:
// 2 * 1/2 * 25 MB at 50 GB/s = 0.5 ms.
TEST(Projection, RingsAcrossHostsTakeTheNetworksBandwidthAndHsdpAddsTheReplicasAllReduce) {
  const CostModel fsdp = project(measured_on_two(), {16, 1}, Cluster{8, 50});
  EXPECT_DOUBLE_EQ(fsdp.groups[0].allgather_ms, 11.25);
  const CostModel hsdp = project(measured_on_two(), {16, 2}, Cluster{8, 50});
  EXPECT_DOUBLE_EQ(hsdp.groups[0].allgather_ms, 5.25);
  EXPECT_DOUBLE_EQ(hsdp.groups[0].reduce_scatter_ms, 5.75);
  EXPECT_EQ(hsdp.fixed_bytes, 400 + 600 * 2 / 8);
}

TEST(Projection, LayoutsGiveFsdpEverywhereAndHsdpOneReplicaAHost) {
  const MeasuredCost m = measured_on_two();
  const auto rows = project_layouts(m, {}, default_schedule(1), layouts_of({2, 16}, {1}, Cluster{}), Cluster{});
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].layout.world, 2);
  EXPECT_EQ(rows[2].layout.replicas, 2);
  // On its own ranks the projection is the measured model's simulation.
  EXPECT_DOUBLE_EQ(rows[0].step_ms, simulate(m.model, default_schedule(1)).step_ms);
  // One group has nothing to hide its collectives behind: exposed = all of them.
  EXPECT_NEAR(rows[0].exposed_comm_ms, 1.5 * 3, 1e-9);  // its all-gather twice and its reduce-scatter
  EXPECT_GT(rows[1].step_ms, rows[2].step_ms);  // rings within hosts beat one across them
  EXPECT_LT(rows[1].peak_bytes, rows[0].peak_bytes);
}

// The group of measured_on_two split the Megatron way: half its parameters replicated (norms, say),
// each forward 2 gathers and 2 scatters of a 10 MB exchange.
TpShape split_in_two_exchanges() { return TpShape{{TpGroupShape{100'000'000, 10'000'000, 2, 2}}}; }

// 8 GPUs as FSDP 4 x TP 2: a rank holds 100/2 + 100 = 150 MB of the 200 (0.75); its all-gather
// over 4 ranks moves 3/4 * 150 MB at 100 GB/s (1.125 ms) + 0.5 ms latency * 3 steps. An exchange
// is a ring over 2 ranks of 2 x 10 MB: 1/2 of it, 0.1 ms, + 0.5 ms latency * 1 step; four of them a
// forward: 2.4 ms. Each gathered input keeps a second rank's 10 MB for backward. The sharded state
// is 0.75 of the parameters over 4 ranks: fixed 400 + 600 * 0.75 * 2 / 4.
TEST(Projection, TensorParallelSplitsTheGroupAndPricesItsExchanges) {
  const CostModel p = project(measured_on_two(), {8, 1, 2}, Cluster{}, split_in_two_exchanges());
  const GroupCost& g = p.groups[0];
  EXPECT_EQ(g.memory.param_bytes, 150'000'000);
  EXPECT_EQ(g.memory.reduce_input_bytes, 150'000'000);
  EXPECT_EQ(g.memory.sharded_grad_bytes, 75 * 2 / 4);
  EXPECT_DOUBLE_EQ(g.allgather_ms, 1.125 + 1.5);
  EXPECT_DOUBLE_EQ(g.tp_comm_ms, 4 * 0.6);
  EXPECT_EQ(g.saved_bytes, 2 * 10'000'000);
  EXPECT_EQ(g.forward_peak_bytes, 2 * 10'000'000);
  EXPECT_EQ(g.backward_peak_bytes, 10'000'000);
  EXPECT_EQ(p.fixed_bytes, 400 + 225);
  EXPECT_DOUBLE_EQ(g.forward_ms, 10);  // a rank's compute stays
  // The exchanges run on the compute stream, in forward and backward (and again in a recompute).
  CostModel free_exchanges = p;
  free_exchanges.groups[0].tp_comm_ms = 0;
  const Schedule recomputed = uniform_schedule(p.groups, true);
  EXPECT_NEAR(simulate(p, default_schedule(1)).step_ms - simulate(free_exchanges, default_schedule(1)).step_ms,
              2 * 2.4, 1e-9);
  EXPECT_NEAR(simulate(p, recomputed).step_ms - simulate(free_exchanges, recomputed).step_ms, 3 * 2.4, 1e-9);
  // FSDP 8 x TP 2 of 16 GPUs spans two hosts of 8: its all-gather takes the network's 50 GB/s.
  EXPECT_DOUBLE_EQ(project(measured_on_two(), {16, 1, 2}, Cluster{8, 50}, split_in_two_exchanges()).groups[0].allgather_ms,
                   7.0 / 8 * 150e6 / 5e7 + 0.5 * 7);
}

TEST(Projection, LayoutsListEachTpDegreeThatDividesAWorldWithinAHost) {
  std::vector<std::string> names;
  for (const Layout& l : layouts_of({4, 16}, {1, 2, 8}, Cluster{8, 50})) names.push_back(std::to_string(l.world) + " " + l.describe());
  EXPECT_EQ(names, (std::vector<std::string>{"4 FSDP 4", "4 FSDP 2 x TP 2", "16 FSDP 16", "16 HSDP 2x8",
                                             "16 FSDP 8 x TP 2", "16 HSDP 2x4 x TP 2", "16 FSDP 2 x TP 8",
                                             "16 HSDP 2x1 x TP 8"}));
}

// 4 GPUs, a budget between the least each layout needs: the planner takes tp 2 where FSDP alone
// does not fit, and says what FSDP alone would need; with room for both, the faster.
TEST(Planner, ChoosesTheTensorParallelDegreeThatFitsTheBudget) {
  const MeasuredCost m = measured_on_two();
  const std::vector<Layout> layouts = layouts_of({4}, {1, 2}, Cluster{});
  auto plans = plan_layouts(m, split_in_two_exchanges(), layouts, Cluster{}, /*budget_bytes=*/1, /*margin=*/0);
  ASSERT_EQ(plans.size(), 2u);
  ASSERT_FALSE(plans[0].fits() || plans[1].fits());
  EXPECT_EQ(plans[0].layout.tp, 2);  // the least budget first
  const int64_t tp_least = plans[0].smallest_budget_bytes, fsdp_least = plans[1].smallest_budget_bytes;
  ASSERT_LT(tp_least, fsdp_least);
  plans = plan_layouts(m, split_in_two_exchanges(), layouts, Cluster{}, (tp_least + fsdp_least) / 2, 0);
  EXPECT_TRUE(plans[0].fits());
  EXPECT_EQ(plans[0].layout.tp, 2);
  EXPECT_FALSE(plans[1].fits());
  EXPECT_EQ(plans[1].smallest_budget_bytes, fsdp_least);
  plans = plan_layouts(m, split_in_two_exchanges(), layouts, Cluster{}, 2 * fsdp_least, 0);
  ASSERT_TRUE(plans[0].fits() && plans[1].fits());
  EXPECT_LE(plans[0].plan.chosen.prediction.step_ms, plans[1].plan.chosen.prediction.step_ms);
}

TEST(Projection, RefusesWhatItCannotProject) {
  MeasuredCost one = measured_on_two();
  one.world = 1;
  EXPECT_THROW(project(one, {4, 1}, Cluster{}), std::invalid_argument);
  EXPECT_THROW(project(measured_on_two(), {6, 4}, Cluster{}), std::invalid_argument);
  EXPECT_THROW(project(measured_on_two(), {8, 1, 2}, Cluster{}), std::invalid_argument);  // no shape to split
  EXPECT_THROW(project(measured_on_two(), {32, 1, 16}, Cluster{8, 50}, split_in_two_exchanges()),
               std::invalid_argument);  // tp past a host
  EXPECT_THROW(project(measured_on_two(), {6, 1, 4}, Cluster{}, split_in_two_exchanges()), std::invalid_argument);
}

}  // namespace
