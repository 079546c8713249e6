#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <stdexcept>

#include "fsdp/fully_shard.h"

namespace fsdp {
namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string rows_text(const ShardRows& rows) {
  return "rows " + std::to_string(rows.first_row) + "-" + std::to_string(rows.first_row + rows.rows) + " of " +
         shape_text(rows.full_shape);
}

}  // namespace

void ema_update_(torch::nn::Module& ema, torch::nn::Module& model, double decay) {
  const std::string caller = "fsdp::ema_update_(" + ema.name() + ", " + model.name() + "): ";
  if (!(decay >= 0 && decay <= 1))
    throw std::invalid_argument(caller + "decay " + std::to_string(decay) + " is outside [0, 1]");
  const auto averaged = ema.named_parameters(), source = model.named_parameters();
  if (averaged.size() != source.size())
    throw std::invalid_argument(caller + std::to_string(averaged.size()) + " parameters against " +
                                std::to_string(source.size()) + ": the EMA copy must be the same model");
  const std::string fix = "; shard the EMA copy as the model (the same modules, the same communicator)";
  for (size_t i = 0; i < averaged.size(); ++i) {
    const auto& name = averaged[i].key();
    const at::Tensor& target = averaged[i].value();
    const at::Tensor& value = source[i].value();
    if (source[i].key() != name)
      throw std::invalid_argument(caller + "parameter " + std::to_string(i) + " is '" + name + "' in the EMA copy, '" +
                                  source[i].key() + "' in the model: the EMA copy must be the same model");
    const ShardRows a = shard_rows_of(target), b = shard_rows_of(value);
    if (a.first_row != b.first_row || a.rows != b.rows || a.full_shape != b.full_shape)
      throw std::invalid_argument(caller + "'" + name + "' holds " + rows_text(a) + " here in the EMA copy but " +
                                  rows_text(b) + " in the model" + fix);
    if (target.scalar_type() != value.scalar_type() || target.device() != value.device())
      throw std::invalid_argument(caller + "'" + name + "' is " + std::string(c10::toString(target.scalar_type())) +
                                  " on " + target.device().str() + " in the EMA copy, " +
                                  c10::toString(value.scalar_type()) + " on " + value.device().str() + " in the model");
  }
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < averaged.size(); ++i) averaged[i].value().mul_(decay).add_(source[i].value(), 1 - decay);
}

}  // namespace fsdp
