#include "fsdp/plan/projection.h"

#include <algorithm>
#include <string>

#include "fsdp/plan/simulator.h"

namespace fsdp::plan {

namespace {

// The bytes each of `ranks` moves in a ring collective of `bytes` (the gathered or reduced size).
double ring_share(int64_t bytes, int ranks) { return double(ranks - 1) / ranks * double(bytes); }

// A latency measured on a ring of `from` ranks, on one of `to`: it grows with the ring's steps.
double ring_latency(double latency_ms, int from, int to) { return latency_ms * double(to - 1) / double(from - 1); }

// The bus bandwidth (bytes a ms) of a ring collective of `bytes` measured at `measured_ms` over
// `ranks`: the time beyond the latency carries the bytes (0 for a measurement all latency).
double ring_bandwidth(double measured_ms, double latency_ms, int64_t bytes, int ranks) {
  const double transfer_ms = measured_ms - std::min(latency_ms, measured_ms);
  return transfer_ms > 0 ? ring_share(bytes, ranks) / transfer_ms : 0;
}

// A ring collective measured at `measured_ms` over `from` ranks moving `from_bytes`, on `to` ranks
// moving `to_bytes`: its bandwidth part at the measured bandwidth, bounded by
// `bandwidth_cap_bytes_per_ms` (0: none), its latency grown with the ring's steps.
double ring_ms(double measured_ms, double latency_ms, int64_t from_bytes, int64_t to_bytes, int from, int to,
               double bandwidth_cap_bytes_per_ms) {
  if (from_bytes <= 0 || measured_ms <= 0) return measured_ms;
  double bandwidth = ring_bandwidth(measured_ms, latency_ms, from_bytes, from);
  if (bandwidth_cap_bytes_per_ms > 0 && (bandwidth == 0 || bandwidth > bandwidth_cap_bytes_per_ms))
    bandwidth = bandwidth_cap_bytes_per_ms;
  return (bandwidth > 0 ? ring_share(to_bytes, to) / bandwidth : 0) +
         ring_latency(std::min(latency_ms, measured_ms), from, to);
}

// The fastest bus bandwidth a measured all-gather reached within the host: the one the
// tensor-parallel rings run at.
double host_bandwidth(const CostModel& model, int from) {
  double best = 0;
  for (const GroupCost& g : model.groups)
    best = std::max(best, ring_bandwidth(g.allgather_ms, model.allgather_latency_ms, g.memory.param_bytes, from));
  return best;
}

// The same model with every collective free: what the step would take were communication hidden.
CostModel without_collectives(CostModel model) {
  for (GroupCost& g : model.groups) g.allgather_ms = g.reduce_scatter_ms = g.tp_comm_ms = 0;
  model.allgather_latency_ms = model.reduce_scatter_latency_ms = 0;
  return model;
}

void check(const MeasuredCost& measured, const Layout& layout, const Cluster& cluster, const TpShape& tp) {
  if (measured.world < 2)
    throw std::invalid_argument("a projection needs a cost model measured on 2 or more ranks (this one: " +
                                std::to_string(measured.world) + "): one rank runs no collectives to measure");
  if (layout.world < 1 || layout.replicas < 1 || layout.tp < 1 || layout.world % (layout.replicas * layout.tp) != 0)
    throw std::invalid_argument(std::to_string(layout.replicas) + " replicas x tp " + std::to_string(layout.tp) +
                                " do not divide " + std::to_string(layout.world) + " GPUs");
  if (cluster.gpus_per_host < 1 || cluster.between_hosts_gb_per_s <= 0)
    throw std::invalid_argument("a cluster needs at least one GPU a host and a positive network bandwidth");
  if (layout.tp > cluster.gpus_per_host)
    throw std::invalid_argument("tp " + std::to_string(layout.tp) + " spans hosts of " +
                                std::to_string(cluster.gpus_per_host) + " GPUs: tensor parallelism stays within one");
  if (layout.tp > 1 && tp.groups.size() != measured.model.groups.size())
    throw std::invalid_argument("a projection to tp " + std::to_string(layout.tp) + " needs the shape of each of the " +
                                std::to_string(measured.model.groups.size()) + " groups under tensor parallelism (" +
                                std::to_string(tp.groups.size()) + " given)");
}

// Group g's parameters on a tp rank: the split ones divided by tp, the replicated ones whole.
int64_t part_bytes(int64_t bytes, const GroupMemory& measured, const TpGroupShape& shape, int tp) {
  if (tp == 1 || measured.param_bytes <= 0) return bytes;
  const int64_t replicated = std::min(shape.replicated_param_bytes, measured.param_bytes);
  const double held = (double(measured.param_bytes - replicated) / tp + double(replicated)) / double(measured.param_bytes);
  return static_cast<int64_t>(double(bytes) * held);
}

// The group split over `tp` ranks of one host (projection.h): its buffers the part's size, its
// exchanges on the compute stream, its gathered inputs kept for backward.
void split_group(GroupCost& g, const TpGroupShape& shape, int tp, double bandwidth, double latency_ms, int from) {
  const GroupMemory measured = g.memory;
  for (int64_t* bytes : {&g.memory.param_bytes, &g.memory.gather_buffer_bytes, &g.memory.grad_bytes,
                         &g.memory.reduce_input_bytes, &g.memory.sharded_grad_bytes, &g.memory.unsynced_grad_bytes})
    *bytes = part_bytes(*bytes, measured, shape, tp);
  // A gather makes tp ranks' activations of one rank's, a scatter the reverse: the ring moves
  // (tp - 1) / tp of the tp-rank tensor either way.
  const double one_exchange_ms = (bandwidth > 0 ? ring_share(shape.exchange_bytes * tp, tp) / bandwidth : 0) +
                                 ring_latency(latency_ms, from, tp);
  g.tp_comm_ms = (shape.gathers + shape.scatters) * one_exchange_ms;
  const int64_t gathered_extra = (tp - 1) * shape.exchange_bytes;  // a gathered input beyond the rank's own
  g.saved_bytes += shape.gathers * gathered_extra;
  g.forward_peak_bytes += shape.gathers * gathered_extra;
  g.backward_peak_bytes += shape.gathers > 0 ? gathered_extra : 0;  // one gathered gradient at a time
}

}  // namespace

std::string Layout::describe() const {
  std::string text = replicas == 1 ? "FSDP " + std::to_string(shard_ranks())
                                   : "HSDP " + std::to_string(replicas) + "x" + std::to_string(shard_ranks());
  if (tp > 1) text += " x TP " + std::to_string(tp);
  return text;
}

CostModel project(const MeasuredCost& measured, const Layout& layout, const Cluster& cluster, const TpShape& tp) {
  check(measured, layout, cluster, tp);
  const int from = measured.world, to = layout.shard_ranks();
  const double network_bytes_per_ms = cluster.between_hosts_gb_per_s * 1e6;
  // Within a host the measured bandwidth holds; a ring past it crosses the network (tp ranks are
  // neighbours, so a shard group spans hosts once its ranks and their tp parts exceed a host).
  const double ring_cap = to * layout.tp > cluster.gpus_per_host ? network_bytes_per_ms : 0;
  CostModel model = measured.model;
  const double ag_latency = model.allgather_latency_ms, rs_latency = model.reduce_scatter_latency_ms;
  const double tp_bandwidth = host_bandwidth(measured.model, from);
  int64_t measured_param_bytes = 0, part_param_bytes = 0;
  for (size_t i = 0; i < model.groups.size(); ++i) {
    GroupCost& g = model.groups[i];
    const GroupMemory whole = g.memory;
    if (layout.tp > 1) split_group(g, tp.groups[i], layout.tp, tp_bandwidth, ag_latency, from);
    measured_param_bytes += whole.param_bytes;
    part_param_bytes += g.memory.param_bytes;
    if (to == 1) {
      g.allgather_ms = g.reduce_scatter_ms = 0;
    } else {
      g.allgather_ms = ring_ms(g.allgather_ms, ag_latency, whole.param_bytes, g.memory.param_bytes, from, to, ring_cap);
      g.reduce_scatter_ms = ring_ms(g.reduce_scatter_ms, rs_latency, whole.reduce_input_bytes,
                                    g.memory.reduce_input_bytes, from, to, ring_cap);
    }
    g.memory.sharded_grad_bytes = g.memory.sharded_grad_bytes * from / to;
    if (layout.replicas > 1) {  // the replicas' all-reduce of the sharded gradients, over the network
      const int r = layout.replicas;
      const double shard_bytes = double(g.memory.reduce_input_bytes) / to;
      g.reduce_scatter_ms += 2.0 * (r - 1) / r * shard_bytes / network_bytes_per_ms;
    }
  }
  if (to > 1) {
    model.allgather_latency_ms = ring_latency(ag_latency, from, to);
    model.reduce_scatter_latency_ms = ring_latency(rs_latency, from, to);
  } else {
    model.allgather_latency_ms = model.reduce_scatter_latency_ms = 0;
  }
  // The sharded state: a tp part of it over the shard ranks.
  const double held = measured_param_bytes > 0 ? double(part_param_bytes) / double(measured_param_bytes) : 1.0;
  const int64_t sharded = std::min(measured.sharded_fixed_bytes, model.fixed_bytes);
  model.fixed_bytes = model.fixed_bytes - sharded + static_cast<int64_t>(double(sharded) * held * from / to);
  return model;
}

std::vector<Layout> layouts_of(const std::vector<int>& worlds, const std::vector<int>& tp_degrees,
                               const Cluster& cluster) {
  std::vector<Layout> layouts;
  for (int world : worlds)
    for (int tp : tp_degrees) {
      if (tp < 1 || world % tp != 0 || tp > cluster.gpus_per_host) continue;
      layouts.push_back({world, 1, tp});
      if (world > cluster.gpus_per_host && world % cluster.gpus_per_host == 0)
        layouts.push_back({world, world / cluster.gpus_per_host, tp});
    }
  return layouts;
}

std::vector<Projected> project_layouts(const MeasuredCost& measured, const TpShape& tp, const Schedule& schedule,
                                       const std::vector<Layout>& layouts, const Cluster& cluster) {
  std::vector<Projected> rows;
  for (const Layout& layout : layouts) {
    const CostModel model = project(measured, layout, cluster, tp);
    const Prediction p = simulate(model, schedule, /*explain=*/false);
    const double hidden_ms = simulate(without_collectives(model), schedule, false).step_ms;
    rows.push_back({layout, p.step_ms, std::max(0.0, p.step_ms - hidden_ms), p.peak_bytes});
  }
  return rows;
}

std::vector<LayoutPlan> plan_layouts(const MeasuredCost& measured, const TpShape& tp,
                                     const std::vector<Layout>& layouts, const Cluster& cluster,
                                     int64_t budget_bytes, double margin) {
  std::vector<LayoutPlan> plans;
  for (const Layout& layout : layouts) {
    const CostModel model = project(measured, layout, cluster, tp);
    try {
      plans.push_back({layout, plan_schedule(model, budget_bytes, margin), 0});
    } catch (const BudgetTooSmall& e) {
      plans.push_back({layout, {}, e.smallest_budget_bytes});
    }
  }
  std::stable_sort(plans.begin(), plans.end(), [](const LayoutPlan& a, const LayoutPlan& b) {
    if (a.fits() != b.fits()) return a.fits();
    if (!a.fits()) return a.smallest_budget_bytes < b.smallest_budget_bytes;
    const Prediction &pa = a.plan.chosen.prediction, &pb = b.plan.chosen.prediction;
    if (pa.step_ms != pb.step_ms) return pa.step_ms < pb.step_ms;
    return pa.peak_bytes < pb.peak_bytes;
  });
  return plans;
}

}  // namespace fsdp::plan
