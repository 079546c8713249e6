// A cost model measured on a few GPUs of one host, carried to more GPUs and hosts:
// the step the simulator predicts there, FSDP, HSDP and either of them times tensor parallelism.
//
// The model of the interconnect, stated once here:
//   - Each group's all-gather and reduce-scatter is a ring over the ranks that shard it. From the
//     measured time t0 on S0 ranks (less the collective latency l0) the ring's bus bandwidth is
//     (S0 - 1) / S0 * bytes / (t0 - l0); on S ranks the collective takes
//     (S - 1) / S * bytes / bandwidth + l0 * (S - 1) / (S0 - 1): the latency grows with the ring's steps.
//   - Within a host (at most Cluster::gpus_per_host ranks a ring) the measured bandwidth holds;
//     a ring that spans hosts is bounded by the network's per-GPU bandwidth.
//   - HSDP (Layout::replicas > 1) shards over one replica's ranks and then all-reduces each group's
//     sharded gradients across the replicas, a ring over the network: 2 (R - 1) / R of the shard's
//     bytes, after the group's reduce-scatter on its stream.
//   - Per-GPU work is fixed (weak scaling): forward, backward and the optimizer keep their times;
//     the sharded state (CostModel::fixed_bytes' share given by MeasuredCost and each group's
//     sharded gradients) divides by the shard ranks, everything unsharded keeps its size.
//   - Tensor parallelism (Layout::tp > 1, measured without it; TpShape says how the model splits,
//     Megatron-LM's way with sequence parallelism) stays within a host. Each group's split
//     parameters divide by tp (its replicated ones, the norms, do not), and FSDP shards its part
//     over the world / (replicas x tp) ranks holding it. A rank keeps its tokens (weak scaling: a tp
//     group computes tp ranks' tokens together), so compute keeps its time; each forward adds its
//     exchanges (an all-gather of tp ranks' activations, or a reduce-scatter to one rank's) on the
//     compute stream, rings over tp ranks at the bandwidth the measured all-gathers reached
//     (GroupCost::tp_comm_ms; the backward makes as many, a recompute repeats them), and the
//     backward keeps each gathered input: tp times its rank's activations instead of once.
//     Matrix products at 1/tp of their width are assumed as fast a FLOP.
//   - Contention, micro-batches and CPU times are the measured ones.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/plan/cost_model.h"
#include "fsdp/plan/planner.h"
#include "fsdp/plan/schedule.h"

namespace fsdp::plan {

/// The machines a projection is made for.
struct Cluster {
  int gpus_per_host = 8;  ///< GPUs joined by NVLink (the measured bandwidth)
  /// Each GPU's network bandwidth to other hosts, GB/s one way (400 Gb/s NICs, one a GPU: 50).
  double between_hosts_gb_per_s = 50;
};

/// A cost model profiled on `world` ranks of one host (world >= 2: one rank has no collectives to
/// measure), and how much of its fixed bytes is sharded state.
struct MeasuredCost {
  CostModel model;  ///< the profile (plan/measured_step.h)
  int world = 2;    ///< the ranks it was profiled on, each shard group of them
  /// The part of model.fixed_bytes split over the shard ranks: weights and optimizer moments.
  int64_t sharded_fixed_bytes = 0;
};

/// How one group splits under tensor parallelism (see above), for a projection to tp > 1.
struct TpGroupShape {
  /// Of GroupMemory::param_bytes, what every tp rank holds whole (the norms' weights).
  int64_t replicated_param_bytes = 0;
  /// One exchange's bytes on a rank: the group's activations of the rank's tokens (tokens x model
  /// width x the compute dtype's size). An all-gather makes tp of them, a reduce-scatter one.
  int64_t exchange_bytes = 0;
  int gathers = 0;   ///< all-gathers in its forward (each output kept for its backward)
  int scatters = 0;  ///< reduce-scatters in its forward
};

/// How a model splits under tensor parallelism: one TpGroupShape a group, in forward order (empty:
/// it is projected without tp only).
struct TpShape {
  std::vector<TpGroupShape> groups;  ///< as CostModel::groups
};

/// `world` GPUs as `replicas` copies of the model, each split over `tp` of them and sharded over
/// world / (replicas x tp).
struct Layout {
  int world = 1;     ///< GPUs in all
  int replicas = 1;  ///< 1: FSDP; more: HSDP
  int tp = 1;        ///< tensor-parallel degree: 1, none
  /// The ranks one group's state (a tp part of it) is sharded over.
  int shard_ranks() const { return world / (replicas * tp); }
  /// "FSDP 16", "HSDP 2x8", "FSDP 16 x TP 8", "HSDP 2x4 x TP 2".
  std::string describe() const;
};

/// What the simulator predicts of a schedule on one layout.
struct Projected {
  Layout layout;  ///< where
  double step_ms = 0;  ///< the step's time
  /// step_ms less the step with every collective free: the communication compute cannot hide.
  double exposed_comm_ms = 0;
  int64_t peak_bytes = 0;  ///< per GPU
};

/// The measured cost model as it would be on `layout`. Throws std::invalid_argument for a layout
/// whose replicas and tp do not divide its GPUs, a tp beyond a host or without a TpShape of the
/// model's groups, or a measurement on fewer than 2 ranks.
CostModel project(const MeasuredCost& measured, const Layout& layout, const Cluster& cluster,
                  const TpShape& tp = {});

/// For each of `worlds` and each of `tp_degrees` that divides it within a host: FSDP over all of
/// its GPUs, and HSDP with one replica a host where the world spans hosts.
std::vector<Layout> layouts_of(const std::vector<int>& worlds, const std::vector<int>& tp_degrees,
                               const Cluster& cluster);

/// `schedule` simulated on each of `layouts`.
std::vector<Projected> project_layouts(const MeasuredCost& measured, const TpShape& tp, const Schedule& schedule,
                                       const std::vector<Layout>& layouts, const Cluster& cluster);

/// The planner on a projected layout: plan_schedule's answer there, or the least budget it needs.
struct LayoutPlan {
  Layout layout;  ///< where
  Plan plan;      ///< the fastest schedule that fits (empty when none does)
  int64_t smallest_budget_bytes = 0;  ///< none fits: the least budget that would (margin included)
  /// Whether a schedule fits the budget on this layout.
  bool fits() const { return smallest_budget_bytes == 0; }
};

/// The planner choosing the layout: plan_schedule on each of `layouts` (the same world or not),
/// those that fit first, fastest first (equal times: the lower peak), then those that do not, the
/// least budget first.
std::vector<LayoutPlan> plan_layouts(const MeasuredCost& measured, const TpShape& tp,
                                     const std::vector<Layout>& layouts, const Cluster& cluster,
                                     int64_t budget_bytes, double margin = 0.05);

}  // namespace fsdp::plan
