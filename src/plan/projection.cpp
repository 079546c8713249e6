#include "fsdp/plan/projection.h"

#include <algorithm>
#include <string>

#include "fsdp/plan/simulator.h"

namespace fsdp::plan {

namespace {

// A ring collective measured at `measured_ms` over `from` ranks, moving `bytes` (the gathered or
// reduced size), on `to` ranks: its bandwidth part rescaled by the ring's share of the bytes each
// rank moves, bounded by `bandwidth_cap_bytes_per_ms` (0: none), its latency by the ring's steps.
double ring_ms(double measured_ms, double latency_ms, int64_t bytes, int from, int to,
               double bandwidth_cap_bytes_per_ms) {
  if (bytes <= 0 || measured_ms <= 0) return measured_ms;
  const double moved_from = double(from - 1) / from * double(bytes);
  const double moved_to = double(to - 1) / to * double(bytes);
  const double latency = std::min(latency_ms, measured_ms);
  // The time beyond the latency carries the bytes; a measurement all latency has none to rescale.
  const double transfer_ms = measured_ms - latency;
  double bandwidth = transfer_ms > 0 ? moved_from / transfer_ms : 0;
  if (bandwidth_cap_bytes_per_ms > 0 && (bandwidth == 0 || bandwidth > bandwidth_cap_bytes_per_ms))
    bandwidth = bandwidth_cap_bytes_per_ms;
  const double scaled_latency = latency * double(to - 1) / double(from - 1);
  return (bandwidth > 0 ? moved_to / bandwidth : 0) + scaled_latency;
}

// The same model with every collective free: what the step would take were communication hidden.
CostModel without_collectives(CostModel model) {
  for (GroupCost& g : model.groups) g.allgather_ms = g.reduce_scatter_ms = 0;
  model.allgather_latency_ms = model.reduce_scatter_latency_ms = 0;
  return model;
}

}  // namespace

CostModel project(const MeasuredCost& measured, const Layout& layout, const Cluster& cluster) {
  if (measured.world < 2)
    throw std::invalid_argument("a projection needs a cost model measured on 2 or more ranks (this one: " +
                                std::to_string(measured.world) + "): one rank runs no collectives to measure");
  if (layout.world < 1 || layout.replicas < 1 || layout.world % layout.replicas != 0)
    throw std::invalid_argument(std::to_string(layout.replicas) + " replicas do not divide " +
                                std::to_string(layout.world) + " GPUs");
  if (cluster.gpus_per_host < 1 || cluster.between_hosts_gb_per_s <= 0)
    throw std::invalid_argument("a cluster needs at least one GPU a host and a positive network bandwidth");
  const int from = measured.world, to = layout.shard_ranks();
  const double network_bytes_per_ms = cluster.between_hosts_gb_per_s * 1e6;
  const double ring_cap = to > cluster.gpus_per_host ? network_bytes_per_ms : 0;
  CostModel model = measured.model;
  const double ag_latency = model.allgather_latency_ms, rs_latency = model.reduce_scatter_latency_ms;
  for (GroupCost& g : model.groups) {
    if (to == 1) {
      g.allgather_ms = g.reduce_scatter_ms = 0;
    } else {
      g.allgather_ms = ring_ms(g.allgather_ms, ag_latency, g.memory.param_bytes, from, to, ring_cap);
      g.reduce_scatter_ms = ring_ms(g.reduce_scatter_ms, rs_latency, g.memory.reduce_input_bytes, from, to, ring_cap);
    }
    g.memory.sharded_grad_bytes = g.memory.sharded_grad_bytes * from / to;
    if (layout.replicas > 1) {  // the replicas' all-reduce of the sharded gradients, over the network
      const int r = layout.replicas;
      const double shard_bytes = double(g.memory.reduce_input_bytes) / to;
      g.reduce_scatter_ms += 2.0 * (r - 1) / r * shard_bytes / network_bytes_per_ms;
    }
  }
  if (to > 1) {
    model.allgather_latency_ms = ag_latency * double(to - 1) / double(from - 1);
    model.reduce_scatter_latency_ms = rs_latency * double(to - 1) / double(from - 1);
  } else {
    model.allgather_latency_ms = model.reduce_scatter_latency_ms = 0;
  }
  const int64_t sharded = std::min(measured.sharded_fixed_bytes, model.fixed_bytes);
  model.fixed_bytes = model.fixed_bytes - sharded + sharded * from / to;
  return model;
}

std::vector<Projected> project_worlds(const MeasuredCost& measured, const Schedule& schedule,
                                      const std::vector<int>& worlds, const Cluster& cluster) {
  std::vector<Projected> rows;
  for (int world : worlds) {
    std::vector<Layout> layouts{{world, 1}};
    if (world > cluster.gpus_per_host && world % cluster.gpus_per_host == 0)
      layouts.push_back({world, world / cluster.gpus_per_host});
    for (const Layout& layout : layouts) {
      const CostModel model = project(measured, layout, cluster);
      const Prediction p = simulate(model, schedule, /*explain=*/false);
      const double hidden_ms = simulate(without_collectives(model), schedule, false).step_ms;
      rows.push_back({layout, p.step_ms, std::max(0.0, p.step_ms - hidden_ms), p.peak_bytes});
    }
  }
  return rows;
}

}  // namespace fsdp::plan
