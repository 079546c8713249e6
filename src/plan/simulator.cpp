#include "fsdp/plan/simulator.h"

#include <algorithm>
#include <deque>
#include <map>
#include <stdexcept>
#include <utility>

namespace fsdp::plan {

Schedule default_schedule(size_t groups) {
  Schedule s;
  s.checkpoint.assign(groups, false);
  s.reshard_after_forward.assign(groups, true);
  return s;
}

namespace {

class Replay {
 public:
  Replay(const CostModel& model, const Schedule& schedule)
      : model_(model), schedule_(schedule), gathered_at_(model.groups.size(), 0.0),
        unsharded_(model.groups.size(), false) {
    const size_t n = model.groups.size();
    if (schedule.checkpoint.size() != n || schedule.reshard_after_forward.size() != n)
      throw std::invalid_argument("schedule: " + std::to_string(schedule.checkpoint.size()) + " checkpoint and " +
                                  std::to_string(schedule.reshard_after_forward.size()) +
                                  " reshard choices for a model of " + std::to_string(n) + " groups");
    if (model.micro_batches < 1)
      throw std::invalid_argument("cost model: " + std::to_string(model.micro_batches) + " micro-batches");
    if (schedule.prefetch_depth < 0 || schedule.max_inflight_allgathers < 0 ||
        schedule.max_inflight_reduce_scatters < 0)
      throw std::invalid_argument("schedule: prefetch depth and in-flight caps must be 0 or more");
    for (size_t g = 1; g < n; ++g)
      if (model.groups[g].encloses_later)
        throw std::invalid_argument("cost model: only the first group can enclose the others (" +
                                    model.groups[g].name + " does)");
    for (size_t g = 0; g < n; ++g)
      if (schedule.checkpoint[g] && !model.groups[g].checkpointable)
        throw std::invalid_argument("schedule: group " + model.groups[g].name + " cannot be checkpointed");
    allocate("fixed (shards, optimizer state, workspaces)", model.fixed_bytes, "start of the step");
  }

  Prediction run() {
    const int n = static_cast<int>(model_.groups.size());
    const bool root = n > 0 && cost(0).encloses_later;
    for (int g = 0; g < n; ++g) forward_order_.push_back(g);
    if (root) backward_order_.push_back(0);
    for (int g = n - 1; g >= (root ? 1 : 0); --g) backward_order_.push_back(g);

    for (pass_ = 0; pass_ < model_.micro_batches; ++pass_) {
      if (root) gather_and_wait(0, forward_order_, 0);  // the root's parameters come first
      for (int i = root ? 1 : 0; i < n; ++i) {
        gather_and_wait(forward_order_[i], forward_order_, i);
        forward_compute(forward_order_[i]);
      }
      if (root) forward_compute(0);  // the head, after every block
      for (int i = 0; i < n; ++i) backward(backward_order_[i], i);
      if (root) reduce_and_reshard(0, /*beside_compute=*/false);  // the root's gradients are complete last
      // The end of backward waits for every reduce-scatter and adds later passes' outputs into the
      // sharded gradients.
      compute_end_ = std::max(compute_end_, reduce_end_);
      while (!reductions_.empty()) finish_oldest_reduction();
      if (later_reduction())
        for (int g = 0; g < n; ++g) release(reduce_output(g), "end of backward");
    }
    compute(model_.fixed_ms, 0.0, 0.0);  // then the optimizer
    prediction_.step_ms = std::max(compute_end_, cpu_);
    std::sort(prediction_.live_at_peak.begin(), prediction_.live_at_peak.end(),
              [](const LiveBuffer& a, const LiveBuffer& b) { return a.bytes > b.bytes; });
    return prediction_;
  }

 private:
  const GroupCost& cost(int g) const { return model_.groups[g]; }

  // The group's parameters, with the prefetches its start issues; its compute waits for its own.
  void gather_and_wait(int g, const std::vector<int>& order, int position) {
    const int n = static_cast<int>(order.size());
    for (int k = 0; k <= schedule_.prefetch_depth && position + k < n; ++k)
      if (!unsharded_[order[position + k]]) all_gather(order[position + k], /*beside_compute=*/k > 0);
    release("all-gather buffers of " + cost(g).name, "start of " + cost(g).name);
  }

  void forward_compute(int g) {
    compute(cost(g).forward_ms, cost(g).forward_cpu_ms, gathered_at_[g]);
    const bool checkpointed = schedule_.checkpoint[g];
    touch(cost(g).forward_peak_bytes, "forward of " + cost(g).name);
    allocate("activations of " + cost(g).name, checkpointed ? cost(g).checkpoint_saved_bytes : cost(g).saved_bytes,
             "forward of " + cost(g).name);
    if (schedule_.reshard_after_forward[g] && !cost(g).encloses_later) reshard(g);  // a root keeps them
  }

  void backward(int g, int position) {
    gather_and_wait(g, backward_order_, position);
    const std::string during = "backward of " + cost(g).name;
    if (schedule_.checkpoint[g]) {
      compute(cost(g).forward_ms, cost(g).forward_cpu_ms, gathered_at_[g]);
      touch(cost(g).forward_peak_bytes, "recompute of " + cost(g).name);
      allocate("recomputed activations of " + cost(g).name, cost(g).saved_bytes, "recompute of " + cost(g).name);
    }
    compute(cost(g).backward_ms, cost(g).backward_cpu_ms, gathered_at_[g]);
    touch(cost(g).backward_peak_bytes, during);
    release("activations of " + cost(g).name, during);
    if (schedule_.checkpoint[g]) release("recomputed activations of " + cost(g).name, during);
    allocate("gradients of " + cost(g).name, cost(g).grad_bytes, during);
    // Compute follows a group's reduce-scatter unless it is the last to run backward.
    if (!cost(g).encloses_later) reduce_and_reshard(g, position + 1 < static_cast<int>(backward_order_.size()));
  }

  // A pass before the last without communication adds the gradients into the unsynced sums.
  void reduce_and_reshard(int g, bool beside_compute) {
    if (!model_.reduce_every_micro_batch && pass_ + 1 < model_.micro_batches) {
      const std::string sums = "unsynced gradients of " + cost(g).name, during = "backward of " + cost(g).name;
      if (!live_.count(sums)) allocate(sums, cost(g).unsynced_grad_bytes, during);
      release("gradients of " + cost(g).name, during);
    } else {
      reduce_scatter(g, beside_compute);
    }
    reshard(g);
  }

  // A prefetch runs beside the compute of the group that issued it; a group's own all-gather
  // (depth 0, or the first of a pass) has the compute stream waiting for it.
  void all_gather(int g, bool beside_compute) {
    // Past the cap the host waits for the oldest release of gathered memory.
    while (!releases_.empty() && releases_.front() <= cpu_) releases_.pop_front();
    const int cap = schedule_.max_inflight_allgathers;
    while (cap > 0 && static_cast<int>(releases_.size()) >= cap) {
      cpu_ = std::max(cpu_, releases_.front());
      releases_.pop_front();
    }
    allocate("parameters of " + cost(g).name, cost(g).param_bytes, "all-gather of " + cost(g).name);
    allocate("all-gather buffers of " + cost(g).name, cost(g).gather_buffer_bytes, "all-gather of " + cost(g).name);
    const double start = std::max({gather_end_, compute_end_, cpu_});
    gather_end_ = start + cost(g).allgather_ms * (beside_compute ? model_.contention.allgather_stretch : 1.0);
    collectives_.emplace_back(start, gather_end_);
    gathered_at_[g] = gather_end_;
    unsharded_[g] = true;
  }

  void reshard(int g) {
    release("parameters of " + cost(g).name, "reshard of " + cost(g).name);
    unsharded_[g] = false;
    releases_.push_back(compute_end_);  // the last use: the compute issued so far
  }

  // Copies the gradients into the reduce-scatter input (freeing them) and issues it; its output
  // (the sharded gradients) stays to the end of the step.
  void reduce_scatter(int g, bool beside_compute) {
    while (!reductions_.empty() && reductions_.front().first <= cpu_) finish_oldest_reduction();
    const int cap = schedule_.max_inflight_reduce_scatters;
    while (cap > 0 && static_cast<int>(reductions_.size()) >= cap) {
      cpu_ = std::max(cpu_, reductions_.front().first);
      finish_oldest_reduction();
    }
    const std::string during = "reduce-scatter of " + cost(g).name;
    allocate("reduce-scatter input of " + cost(g).name, cost(g).reduce_input_bytes, during);
    allocate(reduce_output(g), cost(g).sharded_grad_bytes, during);
    release("gradients of " + cost(g).name, during);
    release("unsynced gradients of " + cost(g).name, during);  // summed into the input
    const double start = std::max({reduce_end_, compute_end_, cpu_});
    reduce_end_ = start + cost(g).reduce_scatter_ms * (beside_compute ? model_.contention.reduce_scatter_stretch : 1.0);
    collectives_.emplace_back(start, reduce_end_);
    reductions_.emplace_back(reduce_end_, g);
  }

  // The first reduce-scatter's output becomes the sharded gradients (to the step's end); a later
  // pass's is added into them at the end of its backward.
  bool later_reduction() const { return model_.reduce_every_micro_batch && pass_ > 0; }
  std::string reduce_output(int g) const {
    return (later_reduction() ? "reduce-scatter output of " : "sharded gradients of ") + cost(g).name;
  }

  void finish_oldest_reduction() {
    const int g = reductions_.front().second;
    reductions_.pop_front();
    release("reduce-scatter input of " + cost(g).name, "reduce-scatter of " + cost(g).name);
  }

  // Compute beside collectives is slowed by the time they overlap it (the end it reaches that way
  // is found by a few rounds of fixed-point iteration: the overlap grows with the end).
  void compute(double device_ms, double cpu_ms, double not_before) {
    cpu_ += cpu_ms;
    const double start = std::max({compute_end_, cpu_, not_before});
    double end = start + device_ms;
    for (int round = 0; round < 4 && model_.contention.compute_slowdown > 0; ++round)
      end = start + device_ms + model_.contention.compute_slowdown * time_within(collectives_, start, end);
    compute_end_ = end;
  }

  // Memory: what is allocated, by name, in the host's order.
  void allocate(const std::string& what, int64_t bytes, const std::string& during) {
    if (bytes == 0) return;
    live_[what] += bytes;
    in_use_ += bytes;
    note(what, during, 0);
  }
  void release(const std::string& what, const std::string& during) {
    const auto it = live_.find(what);
    if (it == live_.end()) return;
    in_use_ -= it->second;
    live_.erase(it);
    note("freed " + what, during, 0);
  }
  // A momentary high of `extra` bytes above what is allocated (inside a forward or backward).
  void touch(int64_t extra, const std::string& during) { note("inside the " + during, during, extra); }

  void note(const std::string& event, const std::string& during, int64_t extra) {
    prediction_.timeline.emplace_back(event, in_use_ + extra);
    if (in_use_ + extra <= prediction_.peak_bytes) return;
    prediction_.peak_bytes = in_use_ + extra;
    prediction_.peak_during = during;
    prediction_.live_at_peak.clear();
    for (const auto& [what, bytes] : live_) prediction_.live_at_peak.push_back({what, bytes});
    if (extra > 0) prediction_.live_at_peak.push_back({"working memory of the " + during, extra});
  }

  const CostModel& model_;
  const Schedule& schedule_;
  Prediction prediction_;
  std::map<std::string, int64_t> live_;
  int64_t in_use_ = 0;
  double cpu_ = 0, compute_end_ = 0, gather_end_ = 0, reduce_end_ = 0;
  int pass_ = 0;  // of model_.micro_batches
  std::vector<int> forward_order_, backward_order_;
  std::vector<double> gathered_at_;             // when each group's latest all-gather ends
  std::vector<bool> unsharded_;
  std::deque<double> releases_;                 // device times of resharded groups' last uses
  std::deque<std::pair<double, int>> reductions_;  // (end, group) of reduce-scatters in flight
  std::vector<std::pair<double, double>> collectives_;  // (start, end) of every collective issued
};

}  // namespace

Prediction simulate(const CostModel& model, const Schedule& schedule) { return Replay(model, schedule).run(); }

double time_within(const std::vector<std::pair<double, double>>& intervals, double from, double to) {
  double total = 0;
  for (const auto& [start, end] : intervals) total += std::max(0.0, std::min(end, to) - std::max(start, from));
  return total;
}

}  // namespace fsdp::plan
