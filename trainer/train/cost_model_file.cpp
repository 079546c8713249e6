#include "train/cost_model_file.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "fsdp/plan/planner.h"
#include "train/memory.h"

namespace fsdp {
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(GroupMemory, param_bytes, gather_buffer_bytes, grad_bytes,
                                                reduce_input_bytes, sharded_grad_bytes, unsynced_grad_bytes)
namespace plan {
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(GroupCost, name, memory, allgather_ms, reduce_scatter_ms,
                                                forward_peak_bytes, saved_bytes, recompute_saved_bytes,
                                                backward_peak_bytes, forward_ms, backward_ms, forward_cpu_ms,
                                                backward_cpu_ms, handoff_ms, handoff_cpu_ms, recomputable,
                                                encloses_later)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Contention, allgather_stretch, reduce_scatter_stretch,
                                                compute_slowdown)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(CostModel, groups, contention, micro_batches,
                                                reduce_every_micro_batch, allgather_latency_ms,
                                                reduce_scatter_latency_ms, fixed_bytes, fixed_ms,
                                                profiled_peak_bytes, profiled_step_ms)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(MeasuredCost, model, world, sharded_fixed_bytes)
}  // namespace plan

namespace train {

void write_cost_model(const std::string& path, const plan::MeasuredCost& measured) {
  write_file(path, nlohmann::json(measured).dump(1) + "\n");
}

plan::MeasuredCost read_cost_model(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("--project: cannot read '" + path + "': give a file that --cost-model wrote");
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    if (!j.is_object() || !j.contains("model") || !j.contains("world"))
      throw UsageError("--project: '" + path + "' is not a cost model (no \"model\" and \"world\"): give a file "
                       "that --cost-model wrote");
    return j.get<plan::MeasuredCost>();
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("--project: '" + path + "' is not a cost model --cost-model wrote: " + e.what());
  }
}

int64_t sharded_fixed_bytes(const TrainArgs& args, int shard_ranks) {
  if (args.cpu_offload) return 0;
  return kWeightAndMomentBytes * model_config(args).parameter_count() / shard_ranks;
}

std::string projection_report(const TrainArgs& args) {
  plan::MeasuredCost measured = read_cost_model(args.project);
  std::vector<int> worlds;
  std::stringstream list(args.project_worlds);
  for (std::string item; std::getline(list, item, ',');) {
    try {
      size_t used = 0;
      const int world = std::stoi(item, &used);
      if (used != item.size() || world < 1) throw std::invalid_argument(item);
      worlds.push_back(world);
    } catch (const std::exception&) {
      throw UsageError("--project-worlds: '" + item + "' is not a GPU count: give counts like 8,16,64");
    }
  }
  if (worlds.empty()) throw UsageError("--project-worlds: give at least one GPU count");
  const plan::Cluster cluster{args.gpus_per_host, args.network_gb_per_s};
  const plan::Schedule schedule = plan::uniform_schedule(measured.model.groups, args.recompute);
  std::vector<plan::Projected> rows;
  try {
    rows = plan::project_worlds(measured, schedule, worlds, cluster);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--project: ") + e.what());
  }
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line,
                "fsdp-train: %s, measured on %d ranks (%.1f ms a step there); hosts of %d GPUs, %.0f GB/s a GPU "
                "between hosts; %s\n",
                args.project.c_str(), measured.world, measured.model.profiled_step_ms, cluster.gpus_per_host,
                cluster.between_hosts_gb_per_s,
                args.recompute ? "every block recomputed" : "the runtime's default schedule");
  out += line;
  out += "  GPUs  shape        step ms  exposed comm ms  peak a GPU\n";
  for (const auto& r : rows) {
    const std::string shape = r.layout.replicas == 1
                                  ? "FSDP"
                                  : "HSDP " + std::to_string(r.layout.replicas) + "x" +
                                        std::to_string(r.layout.shard_ranks());
    std::snprintf(line, sizeof line, "  %4d  %-11s %8.1f  %15.1f  %10s\n", r.layout.world, shape.c_str(), r.step_ms,
                  r.exposed_comm_ms, plan::format_bytes(r.peak_bytes).c_str());
    out += line;
  }
  return out;
}

}  // namespace train
}  // namespace fsdp
