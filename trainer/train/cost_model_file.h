// The planner's cost model as a file (--cost-model) and its projection to more GPUs (--project):
// a profile measured on a few GPUs, read back on any machine to say what the step would be on many.
#pragma once

#include <string>

#include "fsdp/plan/projection.h"
#include "train/args.h"

namespace fsdp::train {

// A --cost-model file: the measured cost model, the tokens each rank computed a step (0 in files
// of 0.6.0 and before: --project then takes --batch x --seq) and the tp degree it ran at.
struct CostModelFile {
  plan::MeasuredCost measured;
  int64_t tokens_per_rank = 0;
  int tp = 1;  // above 1: measured under --tp, which --project does not carry to other layouts
};

// Writes `file` as JSON to `path` (replacing it: the flag names a file the run makes).
void write_cost_model(const std::string& path, const CostModelFile& file);
// Reads a file write_cost_model wrote; throws UsageError naming the file and what is wrong.
CostModelFile read_cost_model(const std::string& path);
// The sharded part of a planned run's fixed bytes on `shard_ranks` ranks: fp32 weights and AdamW's
// two moments (none on the device with --cpu-offload).
int64_t sharded_fixed_bytes(const TrainArgs& args, int shard_ranks);
// --project: args.project's cost model projected to the layouts of --project-worlds and
// --project-tp (plan::project_layouts), or with --memory-budget the planner's choice of layout and
// schedule for each world (plan::plan_layouts). Throws UsageError.
std::string projection_report(const TrainArgs& args);

}  // namespace fsdp::train
