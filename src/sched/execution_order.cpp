#include "sched/execution_order.h"

#include <algorithm>

namespace fsdp {

void ExecutionOrder::begin_pass() {
  current_.clear();
  departed_ = false;
}

bool ExecutionOrder::observe(int group) {
  if (std::find(current_.begin(), current_.end(), group) != current_.end()) return !departed_;
  const size_t position = current_.size();
  current_.push_back(group);
  if (!departed_ && has_record() &&
      (position >= recorded_.size() || recorded_[position] != group)) {
    departed_ = true;
    ++departures_;
  }
  return !departed_;
}

void ExecutionOrder::end_pass() {
  if (!current_.empty()) recorded_ = current_;
  current_.clear();
  departed_ = false;
}

std::vector<int> ExecutionOrder::next(int group, int depth) const {
  std::vector<int> out;
  if (departed_ || depth <= 0) return out;
  auto it = std::find(recorded_.begin(), recorded_.end(), group);
  if (it == recorded_.end()) return out;
  for (++it; it != recorded_.end() && static_cast<int>(out.size()) < depth; ++it) out.push_back(*it);
  return out;
}

}  // namespace fsdp
