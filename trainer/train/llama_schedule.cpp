#include "train/llama_schedule.h"

#include <stdexcept>

#include "fsdp/fully_shard.h"
#include "fsdp/planning.h"

namespace fsdp::train {
namespace {

// Checks the schedule against the model and sets which blocks the Llama recomputes.
void apply_recompute(model::Llama& model, const plan::Schedule& schedule) {
  const size_t groups = model->blocks.size() + 1;
  if (schedule.recompute.size() != groups || schedule.reshard_after_forward.size() != groups)
    throw std::invalid_argument("apply_schedule: the schedule has " + std::to_string(schedule.recompute.size()) +
                                " groups, the model " + std::to_string(groups) + " (the root and each block)");
  if (schedule.recompute[0]) throw std::invalid_argument("apply_schedule: the root group cannot be recomputed");
  auto& config = model->config;
  config.recompute_blocks = false;
  config.recomputed_blocks.clear();
  for (size_t i = 0; i < model->blocks.size(); ++i)
    if (schedule.recompute[i + 1]) config.recomputed_blocks.push_back(static_cast<int64_t>(i));
}

}  // namespace

plan::Schedule llama_schedule(const model::LlamaConfig& config, bool reshard_after_forward,
                              const RuntimeOptions& runtime) {
  plan::Schedule s = plan::default_schedule(static_cast<size_t>(config.n_layers) + 1);
  for (int64_t i = 0; i < config.n_layers; ++i) {
    s.recompute[i + 1] = config.recomputes(i);
    s.reshard_after_forward[i + 1] = reshard_after_forward;
  }
  s.reshard_after_forward[0] = false;  // the root keeps its parameters (fully_shard's rule)
  s.runtime = runtime;
  return s;
}

void shard_with_schedule(model::Llama& model, const plan::Schedule& schedule, ShardOptions shard) {
  apply_recompute(model, schedule);
  for (size_t i = 0; i < model->blocks.size(); ++i) {
    ShardOptions block_shard = shard;
    block_shard.reshard_after_forward = schedule.reshard_after_forward[i + 1];
    fully_shard(model->blocks[i], block_shard);
  }
  fully_shard(model, shard);
  set_runtime_choices(*model, schedule);
}

void apply_schedule(model::Llama& model, const plan::Schedule& schedule) {
  apply_recompute(model, schedule);
  set_schedule(*model, schedule);
}

}  // namespace fsdp::train
