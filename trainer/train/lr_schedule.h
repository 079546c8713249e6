#pragma once

namespace fsdp::train {

// Linear warmup from lr/warmup to lr over `warmup` steps, then cosine decay to
// min_lr at `total` steps (step counts from 0).
struct LrSchedule {
  double lr = 3e-4;
  double min_lr = 3e-5;
  int warmup = 10;
  int total = 100;
  double at(int step) const;
};

}  // namespace fsdp::train
