// A schedule (fsdp/plan/cost_model.h) applied to fsdp-train's Llama: its parameter groups are the
// root (embeddings, final norm, head: group 0, first in forward order) and each block (groups 1..n).
#pragma once

#include <string>
#include <vector>

#include "fsdp/options.h"
#include "fsdp/plan/cost_model.h"
#include "fsdp/plan/schedule.h"
#include "fsdp/runtime_options.h"
#include "model/llama.h"

namespace fsdp::train {

// The schedule of fsdp-train's flags: every block recomputed or none, every block resharded
// after forward or none (the root always keeps its parameters), the runtime's depth and caps.
plan::Schedule llama_schedule(const model::LlamaConfig& config, bool reshard_after_forward,
                              const RuntimeOptions& runtime);

// Shards each block and then the root with `shard` and the schedule's per-group reshard choice,
// then its runtime choices (llama_schedule's schedules set no group's own prefetch depth;
// apply_schedule sets a planned one's).
void shard_with_schedule(model::Llama& model, const plan::Schedule& schedule, ShardOptions shard);

// On a sharded model: recomputes the blocks the schedule names, sets each group's reshard choice
// and own prefetch depth (after a step has recorded the forward order: fsdp::set_schedule) and the runtime's prefetch
// depth, caps and buckets. Throws std::invalid_argument when the schedule is not one
// of this model's groups or recomputes the root.
void apply_schedule(model::Llama& model, const plan::Schedule& schedule);

}  // namespace fsdp::train
