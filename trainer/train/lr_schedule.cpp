#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace fsdp::train {

double LrSchedule::at(int step) const {
  if (step < warmup) return lr * (step + 1) / warmup;
  if (total <= warmup) return lr;
  const double progress = std::min(1.0, double(step - warmup) / double(total - warmup));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace fsdp::train
