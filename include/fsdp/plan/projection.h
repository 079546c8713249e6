// A cost model measured on a few GPUs of one host, carried to more GPUs and hosts:
// the step the simulator predicts there, FSDP and HSDP shapes.
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
//   - Contention, micro-batches and CPU times are the measured ones.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "fsdp/plan/cost_model.h"
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

/// `world` GPUs as `replicas` copies of the model, each sharded over world / replicas of them.
struct Layout {
  int world = 1;     ///< GPUs in all
  int replicas = 1;  ///< 1: FSDP; more: HSDP
  /// The ranks one group's state is sharded over.
  int shard_ranks() const { return world / replicas; }
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
/// whose replicas do not divide its GPUs, or a measurement on fewer than 2 ranks.
CostModel project(const MeasuredCost& measured, const Layout& layout, const Cluster& cluster);

/// For each of `worlds`: FSDP over all of them, and HSDP with one replica a host where the world
/// spans hosts (gpus_per_host ranks a shard group); `schedule` simulated on each.
std::vector<Projected> project_worlds(const MeasuredCost& measured, const Schedule& schedule,
                                      const std::vector<int>& worlds, const Cluster& cluster);

}  // namespace fsdp::plan
