// The order in which parameter groups run in a pass (forward, or backward),
// recorded in one step and used to prefetch in the next. Pure bookkeeping
// on group ids, so it is unit-tested without tensors.
//
// A pass lists each group once, at its first appearance. If the current pass
// departs from the recorded one, prefetching stops for the rest of the pass
// (a guess could only be wrong) and the new order is recorded at its end.
#pragma once

#include <vector>

namespace fsdp {

class ExecutionOrder {
 public:
  void begin_pass();
  // `group` starts running. Returns false when this departs from the record.
  bool observe(int group);
  // Records the pass just finished; it steers the next one.
  void end_pass();
  // Up to `depth` groups expected to run after `group` in this pass; empty
  // without a record, after a departure, or for a group not in the record.
  std::vector<int> next(int group, int depth) const;

  bool has_record() const { return !recorded_.empty(); }
  const std::vector<int>& recorded() const { return recorded_; }
  int departures() const { return departures_; }

 private:
  std::vector<int> recorded_;
  std::vector<int> current_;
  bool departed_ = false;
  int departures_ = 0;
};

}  // namespace fsdp
