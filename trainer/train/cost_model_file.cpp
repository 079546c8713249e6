#include "train/cost_model_file.h"

#include <algorithm>
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
                                                backward_peak_bytes, forward_ms, backward_ms, tp_comm_ms, forward_cpu_ms,
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

void write_cost_model(const std::string& path, const CostModelFile& file) {
  nlohmann::json j = file.measured;
  j["tokens_per_rank"] = file.tokens_per_rank;
  j["tp"] = file.tp;
  write_file(path, j.dump(1) + "\n");
}

CostModelFile read_cost_model(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("--project: cannot read '" + path + "': give a file that --cost-model wrote");
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    if (!j.is_object() || !j.contains("model") || !j.contains("world"))
      throw UsageError("--project: '" + path + "' is not a cost model (no \"model\" and \"world\"): give a file "
                       "that --cost-model wrote");
    return {j.get<plan::MeasuredCost>(), j.value("tokens_per_rank", int64_t(0)), j.value("tp", 1)};
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("--project: '" + path + "' is not a cost model --cost-model wrote: " + e.what());
  }
}

int64_t sharded_fixed_bytes(const TrainArgs& args, int shard_ranks) {
  if (args.cpu_offload) return 0;
  return kWeightAndMomentBytes * model_config(args).parameter_count() / shard_ranks;
}

namespace {

// "8,16,64" as numbers of at least 1; throws UsageError naming `flag`.
std::vector<int> counts_of(const std::string& flag, const std::string& text, const std::string& example) {
  std::vector<int> counts;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) {
    try {
      size_t used = 0;
      const int count = std::stoi(item, &used);
      if (used != item.size() || count < 1) throw std::invalid_argument(item);
      counts.push_back(count);
    } catch (const std::exception&) {
      throw UsageError(flag + ": '" + item + "' is not a count of at least 1: give counts like " + example);
    }
  }
  if (counts.empty()) throw UsageError(flag + ": give at least one count, like " + example);
  return counts;
}

// How the trainer's Llama splits (model/llama.cpp, tensor parallelism): each block all-gathers
// its tokens' activations before attention and before the MLP and reduce-scatters after each;
// the root reduce-scatters the vocabulary-parallel embedding's output and all-gathers the final
// norm's before the head. The norms' weights are replicated. Checked against the cost model's
// groups: each block's parameter bytes must be the model's block in one dtype.
plan::TpShape llama_tp_shape(const TrainArgs& args, const CostModelFile& file, const std::vector<int>& degrees,
                             int64_t tokens) {
  const model::LlamaConfig config = model_config(args);
  const auto& groups = file.measured.model.groups;
  const auto mismatch = [&](const std::string& what) {
    return UsageError("--project-tp: " + args.project + " is not a profile of the " + model_name(args) + " model (" +
                      what + "): give the --model or --init-from it was measured with");
  };
  if (groups.size() != size_t(config.n_layers) + 1 || !groups[0].encloses_later)
    throw mismatch(std::to_string(groups.size()) + " groups, not a root and " + std::to_string(config.n_layers) + " blocks");
  const int64_t block_bytes = groups[1].memory.param_bytes;
  const int64_t element = block_bytes / config.block_parameter_count();
  if (element < 1 || block_bytes != element * config.block_parameter_count())
    throw mismatch("a block of " + std::to_string(block_bytes) + " bytes, not " +
                   std::to_string(config.block_parameter_count()) + " parameters of one dtype");
  for (int tp : degrees) {
    const std::string unsplit = unsplit_by_tp(config, tp);
    if (!unsplit.empty())
      throw UsageError("--project-tp " + std::to_string(tp) + ": the " + model_name(args) + " model's " + unsplit +
                       " must divide by it: choose degrees that divide them");
  }
  const int64_t exchange = tokens * config.dim * element;
  plan::TpShape shape;
  shape.groups.push_back({config.dim * element, exchange, /*gathers=*/1, /*scatters=*/1});
  for (int64_t b = 0; b < config.n_layers; ++b) shape.groups.push_back({2 * config.dim * element, exchange, 2, 2});
  return shape;
}

// --project with --memory-budget: per world, the planner's choice of layout and schedule.
std::string layout_plan_report(const TrainArgs& args, const CostModelFile& file, const plan::TpShape& tp,
                               const std::vector<plan::Layout>& layouts, const plan::Cluster& cluster) {
  const auto budget = static_cast<int64_t>(args.memory_budget_gib * double(int64_t(1) << 30));
  std::string out;
  char line[320];
  for (size_t first = 0; first < layouts.size();) {
    size_t end = first;
    while (end < layouts.size() && layouts[end].world == layouts[first].world) ++end;
    const std::vector<plan::Layout> same_world(layouts.begin() + first, layouts.begin() + end);
    const auto plans = plan::plan_layouts(file.measured, tp, same_world, cluster, budget);
    std::snprintf(line, sizeof line, "  %d GPUs, a budget of %s each:\n", layouts[first].world,
                  plan::format_bytes(budget).c_str());
    out += line;
    for (const plan::LayoutPlan& p : plans) {
      if (p.fits())
        std::snprintf(line, sizeof line, "    %-21s %8.1f ms  peak %10s%s\n", p.layout.describe().c_str(),
                      p.plan.chosen.prediction.step_ms, plan::format_bytes(p.plan.chosen.prediction.peak_bytes).c_str(),
                      &p == &plans.front() ? "  <- chosen" : "");
      else
        std::snprintf(line, sizeof line, "    %-21s does not fit: needs a budget of %s\n", p.layout.describe().c_str(),
                      plan::format_bytes(p.smallest_budget_bytes).c_str());
      out += line;
    }
    if (plans.front().fits())
      out += "      chosen schedule: " +
             plan::describe(plans.front().plan.chosen.schedule, file.measured.model) + "\n";  // its groups' names
    first = end;
  }
  return out;
}

}  // namespace

std::string projection_report(const TrainArgs& args) {
  const CostModelFile file = read_cost_model(args.project);
  if (file.tp > 1)
    throw UsageError("--project: " + args.project + " was measured with --tp " + std::to_string(file.tp) +
                     ", and a projection starts from a profile without tensor parallelism (the tp collectives are "
                     "in its compute): measure one without --tp, and give --project-tp the degrees to try");
  const plan::MeasuredCost& measured = file.measured;
  const std::vector<int> worlds = counts_of("--project-worlds", args.project_worlds, "8,16,64");
  const std::vector<int> degrees = counts_of("--project-tp", args.project_tp, "1,2,4,8");
  const bool split = std::any_of(degrees.begin(), degrees.end(), [](int tp) { return tp > 1; });
  const int64_t tokens = file.tokens_per_rank > 0 ? file.tokens_per_rank : int64_t(args.batch) * args.seq;
  const plan::TpShape tp = split ? llama_tp_shape(args, file, degrees, tokens) : plan::TpShape{};
  const plan::Cluster cluster{args.gpus_per_host, args.network_gb_per_s};
  const std::vector<plan::Layout> layouts = plan::layouts_of(worlds, degrees, cluster);
  if (layouts.empty())
    throw UsageError("--project-tp: none of the degrees divides a world of --project-worlds within a host of " +
                     std::to_string(cluster.gpus_per_host) + " GPUs: give degrees that do");
  std::string out;
  char line[320];
  std::snprintf(line, sizeof line,
                "fsdp-train: %s, measured on %d ranks (%.1f ms a step there); hosts of %d GPUs, %.0f GB/s a GPU "
                "between hosts; %s\n",
                args.project.c_str(), measured.world, measured.model.profiled_step_ms, cluster.gpus_per_host,
                cluster.between_hosts_gb_per_s,
                args.memory_budget_gib > 0 ? "the planner's schedule for --memory-budget"
                : args.recompute           ? "every block recomputed"
                                           : "the runtime's default schedule");
  out += line;
  if (split)
    out += "fsdp-train: tensor parallelism as the " + model_name(args) + " model splits, " + std::to_string(tokens) +
           " tokens a rank" +
           (file.tokens_per_rank > 0 ? "" : " (--batch x --seq: the file does not record them; give those it was measured with)") +
           "\n";
  try {
    if (args.memory_budget_gib > 0) return out + layout_plan_report(args, file, tp, layouts, cluster);
    const plan::Schedule schedule = plan::uniform_schedule(measured.model.groups, args.recompute);
    out += "  GPUs  layout                 step ms  exposed comm ms  peak a GPU\n";
    for (const auto& r : plan::project_layouts(measured, tp, schedule, layouts, cluster)) {
      std::snprintf(line, sizeof line, "  %4d  %-21s %8.1f  %15.1f  %10s\n", r.layout.world,
                    r.layout.describe().c_str(), r.step_ms, r.exposed_comm_ms, plan::format_bytes(r.peak_bytes).c_str());
      out += line;
    }
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--project: ") + e.what());
  }
  return out;
}

}  // namespace train
}  // namespace fsdp
