#include "fsdp/plan/simulator.h"

#include <algorithm>
#include <deque>
#include <string>
#include <stdexcept>
#include <utility>

namespace fsdp::plan {

Schedule default_schedule(size_t groups) {
  Schedule s;
  s.recompute.assign(groups, false);
  s.reshard_after_forward.assign(groups, true);
  s.prefetch_depth.assign(groups, -1);
  return s;
}

namespace {

// The buffers the replay tracks, per group (kFixed: one, the step's fixed bytes).
enum Buffer {
  kFixed, kParameters, kGatherBuffers, kActivations, kRecomputed, kGradients, kUnsynced, kReduceInput,
  kShardedGradients, kReduceOutput, kBufferKinds
};

const char* buffer_name(Buffer b) {
  static const char* const names[kBufferKinds] = {
      "fixed (shards, optimizer state, workspaces)", "parameters of ", "all-gather buffers of ", "activations of ",
      "recomputed activations of ", "gradients of ", "unsynced gradients of ", "reduce-scatter input of ",
      "sharded gradients of ", "reduce-scatter output of "};
  return names[b];
}

// What the step is doing when memory changes ("backward of blocks.3", "all-gather of A + C"): kept
// as parts and put into words only to explain a prediction.
struct Phase {
  const char* what;                           // "backward of ", or a whole phrase when no group
  int group = -1;                             // the group it names, or
  const std::vector<int>* members = nullptr;  // the groups of a bucket
};

class Replay {
 public:
  Replay(const CostModel& model, const Schedule& schedule, bool explain)
      : model_(model), schedule_(schedule), explain_(explain),
        bucket_limit_(schedule.runtime.bucket_bytes()),
        live_((kBufferKinds - 1) * model.groups.size() + 1, 0), gathered_at_(model.groups.size(), 0.0),
        unsharded_(model.groups.size(), false) {
    const size_t n = model.groups.size();
    if (schedule.recompute.size() != n || schedule.reshard_after_forward.size() != n)
      throw std::invalid_argument("schedule: " + std::to_string(schedule.recompute.size()) + " recompute and " +
                                  std::to_string(schedule.reshard_after_forward.size()) +
                                  " reshard choices for a model of " + std::to_string(n) + " groups");
    if (!schedule.prefetch_depth.empty() && schedule.prefetch_depth.size() != n)
      throw std::invalid_argument("schedule: " + std::to_string(schedule.prefetch_depth.size()) +
                                  " prefetch depths for a model of " + std::to_string(n) + " groups");
    for (int depth : schedule.prefetch_depth)
      if (depth < -1)
        throw std::invalid_argument("schedule: a group's prefetch depth is " + std::to_string(depth) +
                                    "; it must be 0 or more, or -1 for the runtime's");
    if (model.micro_batches < 1)
      throw std::invalid_argument("cost model: " + std::to_string(model.micro_batches) + " micro-batches");
    check_runtime_options(schedule.runtime, "schedule");
    for (size_t g = 1; g < n; ++g)
      if (model.groups[g].encloses_later)
        throw std::invalid_argument("cost model: only the first group can enclose the others (" +
                                    model.groups[g].name + " does)");
    for (size_t g = 0; g < n; ++g)
      if (schedule.recompute[g] && !model.groups[g].recomputable)
        throw std::invalid_argument("schedule: group " + model.groups[g].name + " cannot be recomputed");
    allocate(kFixed, 0, model.fixed_bytes, {"start of the step"});
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
      flush_reduce_bucket(/*beside_compute=*/false);
      // The end of backward waits for every reduce-scatter and adds later passes' outputs into the
      // sharded gradients.
      compute_end_ = std::max(compute_end_, reduce_end_);
      while (!reductions_.empty()) finish_oldest_reduction();
      if (later_reduction())
        for (int g = 0; g < n; ++g) release(kReduceOutput, g, {"end of backward"});
    }
    compute(model_.fixed_ms, 0.0, 0.0);  // then the optimizer
    prediction_.step_ms = std::max(compute_end_, cpu_);
    std::stable_sort(prediction_.live_at_peak.begin(), prediction_.live_at_peak.end(),
              [](const LiveBuffer& a, const LiveBuffer& b) { return a.bytes > b.bytes; });
    return prediction_;
  }

 private:
  const GroupCost& cost(int g) const { return model_.groups[g]; }

  // The group's parameters, with the prefetches its start issues; its compute waits for its own.
  void gather_and_wait(int g, const std::vector<int>& order, int position) {
    const int n = static_cast<int>(order.size());
    for (int k = 0; k <= schedule_.prefetch_depth_of(g) && position + k < n; ++k)
      if (!unsharded_[order[position + k]]) all_gather(order, position + k, /*beside_compute=*/k > 0);
    release(kGatherBuffers, g, {"start of ", g});
  }

  void forward_compute(int g) {
    compute(cost(g).forward_ms + cost(g).tp_comm_ms, cost(g).forward_cpu_ms, gathered_at_[g]);
    const bool recomputed = schedule_.recompute[g];
    touch(cost(g).forward_peak_bytes, {"forward of ", g});
    allocate(kActivations, g, recomputed ? cost(g).recompute_saved_bytes : cost(g).saved_bytes,
             {"forward of ", g});
    if (schedule_.reshard_after_forward[g] && !cost(g).encloses_later) reshard(g);  // a root keeps them
  }

  void backward(int g, int position) {
    gather_and_wait(g, backward_order_, position);
    const Phase during{"backward of ", g};
    if (schedule_.recompute[g]) {
      compute(cost(g).forward_ms + cost(g).tp_comm_ms, cost(g).forward_cpu_ms, gathered_at_[g]);
      touch(cost(g).forward_peak_bytes, {"recompute of ", g});
      allocate(kRecomputed, g, cost(g).saved_bytes, {"recompute of ", g});
    }
    compute(cost(g).backward_ms + cost(g).tp_comm_ms, cost(g).backward_cpu_ms, gathered_at_[g]);
    touch(cost(g).backward_peak_bytes, during);
    release(kActivations, g, during);
    release(kRecomputed, g, during);
    allocate(kGradients, g, cost(g).memory.grad_bytes, during);
    // Compute follows a group's reduce-scatter unless it is the last to run backward.
    if (!cost(g).encloses_later) reduce_and_reshard(g, position + 1 < static_cast<int>(backward_order_.size()));
  }

  // The runtime's order (GroupState::hand_off_gradients): the parameters are freed first, then a
  // pass before the last without communication adds the gradients into the unsynced sums.
  void reduce_and_reshard(int g, bool beside_compute) {
    reshard(g);
    if (!model_.reduce_every_micro_batch && pass_ + 1 < model_.micro_batches) {
      const Phase during{"backward of ", g};
      if (live(kUnsynced, g) == 0) allocate(kUnsynced, g, cost(g).memory.unsynced_grad_bytes, during);
      release(kGradients, g, during);
    } else {
      compute(cost(g).handoff_ms, cost(g).handoff_cpu_ms, 0.0);
      reduce_scatter(g, beside_compute);
    }
  }

  bool small(int g) const { return bucket_limit_ > 0 && cost(g).memory.param_bytes < bucket_limit_; }

  // order[position]'s group and, when it is small, the small groups after it in the pass that are
  // still sharded (past large ones), while they fit in the bucket: the runtime's membership.
  std::vector<int> gather_bucket(const std::vector<int>& order, int position) const {
    std::vector<int> members{order[position]};
    if (!small(members[0])) return members;
    int64_t bytes = cost(members[0]).memory.param_bytes;
    for (size_t i = position + 1; i < order.size(); ++i) {
      const int next = order[i];
      if (!small(next) || unsharded_[next]) continue;
      if (bytes + cost(next).memory.param_bytes > bucket_limit_) break;
      members.push_back(next);
      bytes += cost(next).memory.param_bytes;
    }
    return members;
  }

  // One collective for the members: their times alone, less a latency for each but the first.
  double coalesced_ms(const std::vector<int>& members, double GroupCost::*ms, double latency_ms) const {
    double sum = 0, longest = 0;
    for (int g : members) {
      sum += cost(g).*ms;
      longest = std::max(longest, cost(g).*ms);
    }
    return std::max(longest, sum - latency_ms * double(members.size() - 1));
  }

  // A prefetch runs beside the compute of the group that issued it; a group's own all-gather
  // (depth 0, or the first of a pass) has the compute stream waiting for it.
  void all_gather(const std::vector<int>& order, int position, bool beside_compute) {
    const std::vector<int> members = gather_bucket(order, position);
    // Past the cap the host waits for the oldest release of gathered memory.
    while (!releases_.empty() && releases_.front() <= cpu_) releases_.pop_front();
    const int cap = schedule_.runtime.max_inflight_allgathers;
    while (cap > 0 && static_cast<int>(releases_.size()) >= cap) {
      cpu_ = std::max(cpu_, releases_.front());
      releases_.pop_front();
    }
    const Phase during{"all-gather of ", -1, &members};
    for (int g : members) {
      allocate(kParameters, g, cost(g).memory.param_bytes, during);
      allocate(kGatherBuffers, g, cost(g).memory.gather_buffer_bytes, during);
    }
    const double start = std::max({gather_end_, compute_end_, cpu_});
    gather_end_ = start + coalesced_ms(members, &GroupCost::allgather_ms, model_.allgather_latency_ms) *
                              (beside_compute ? model_.contention.allgather_stretch : 1.0);
    collectives_.emplace_back(start, gather_end_);
    for (int g : members) {
      gathered_at_[g] = gather_end_;
      unsharded_[g] = true;
    }
  }

  void reshard(int g) {
    release(kParameters, g, {"reshard of ", g});
    unsharded_[g] = false;
    releases_.push_back(compute_end_);  // the last use: the compute issued so far
  }

  // Copies the gradients into the reduce-scatter input (freeing them), then issues the bucket once
  // it holds bucket_mb (at once without bucketing) or reduce_bucket_max_wait groups joined it late.
  void reduce_scatter(int g, bool beside_compute) {
    const Phase during{"reduce-scatter of ", g};
    allocate(kReduceInput, g, cost(g).memory.reduce_input_bytes, during);
    release(kGradients, g, during);
    release(kUnsynced, g, during);  // summed into the input
    const bool waiting = !reduce_bucket_.empty();
    reduce_bucket_.push_back(g);
    reduce_bucket_bytes_ += cost(g).memory.param_bytes;
    const int max_wait = schedule_.runtime.reduce_bucket_max_wait;
    const bool waited_enough = waiting && max_wait > 0 && ++reduce_bucket_waited_ >= max_wait;
    if (reduce_bucket_bytes_ >= bucket_limit_ || waited_enough) flush_reduce_bucket(beside_compute);
  }

  void flush_reduce_bucket(bool beside_compute) {
    if (reduce_bucket_.empty()) return;
    issue_reduce_scatter(reduce_bucket_, beside_compute);
    reduce_bucket_.clear();
    reduce_bucket_bytes_ = 0;
    reduce_bucket_waited_ = 0;
  }

  // One collective for the members, within the in-flight cap; its outputs (the sharded gradients)
  // stay to the end of the step.
  void issue_reduce_scatter(const std::vector<int>& members, bool beside_compute) {
    while (!reductions_.empty() && reductions_.front().first <= cpu_) finish_oldest_reduction();
    const int cap = schedule_.runtime.max_inflight_reduce_scatters;
    while (cap > 0 && static_cast<int>(reductions_.size()) >= cap) {  // the compute stream waits, not the host
      compute_not_before_ = std::max(compute_not_before_, reductions_.front().first);
      finish_oldest_reduction();
    }
    for (int g : members)
      allocate(reduce_output(), g, cost(g).memory.sharded_grad_bytes, {"reduce-scatter of ", -1, &members});
    const double start = std::max({reduce_end_, compute_end_, cpu_});
    reduce_end_ = start + coalesced_ms(members, &GroupCost::reduce_scatter_ms, model_.reduce_scatter_latency_ms) *
                              (beside_compute ? model_.contention.reduce_scatter_stretch : 1.0);
    collectives_.emplace_back(start, reduce_end_);
    reductions_.emplace_back(reduce_end_, members);
  }

  // The first reduce-scatter's output becomes the sharded gradients (to the step's end); a later
  // pass's is added into them at the end of its backward.
  bool later_reduction() const { return model_.reduce_every_micro_batch && pass_ > 0; }
  Buffer reduce_output() const { return later_reduction() ? kReduceOutput : kShardedGradients; }

  void finish_oldest_reduction() {
    const std::vector<int> members = std::move(reductions_.front().second);
    reductions_.pop_front();
    for (int g : members) release(kReduceInput, g, {"reduce-scatter of ", -1, &members});
  }

  // Compute beside collectives is slowed by the time they overlap it (the end it reaches that way
  // is found by a few rounds of fixed-point iteration: the overlap grows with the end).
  void compute(double device_ms, double cpu_ms, double not_before) {
    cpu_ += cpu_ms;
    const double start = std::max({compute_end_, cpu_, not_before, compute_not_before_});
    double end = start + device_ms;
    for (int round = 0; round < 4 && model_.contention.compute_slowdown > 0; ++round)
      end = start + device_ms + model_.contention.compute_slowdown * time_within(collectives_, start, end);
    compute_end_ = end;
  }

  // Memory: what is allocated, per buffer of each group, in the host's order.
  int64_t& live(Buffer b, int g) { return live_[b == kFixed ? 0 : 1 + (b - 1) * model_.groups.size() + g]; }
  void allocate(Buffer b, int g, int64_t bytes, const Phase& during) {
    if (bytes == 0) return;
    live(b, g) += bytes;
    in_use_ += bytes;
    note(b, g, "", during, 0);
  }
  void release(Buffer b, int g, const Phase& during) {
    int64_t& bytes = live(b, g);
    if (bytes == 0) return;
    in_use_ -= bytes;
    bytes = 0;
    note(b, g, "freed ", during, 0);
  }
  // A momentary high of `extra` bytes above what is allocated (inside a forward or backward).
  void touch(int64_t extra, const Phase& during) { note(kBufferKinds, -1, "inside the ", during, extra); }

  std::string name(Buffer b, int g) const { return buffer_name(b) + (b == kFixed ? "" : cost(g).name); }
  std::string words(const Phase& p) const {
    std::string out = p.what;
    if (p.group >= 0) return out + cost(p.group).name;
    if (p.members)
      for (size_t i = 0; i < p.members->size(); ++i) out += (i ? " + " : "") + cost((*p.members)[i]).name;
    return out;
  }

  // Buffer b of group g changed (b == kBufferKinds: a touch); only an explained replay keeps the
  // timeline and what is live at the peak.
  void note(Buffer b, int g, const char* change, const Phase& during, int64_t extra) {
    const int64_t level = in_use_ + extra;
    if (explain_)
      prediction_.timeline.emplace_back(change + (b == kBufferKinds ? words(during) : name(b, g)), level);
    if (level <= prediction_.peak_bytes) return;
    prediction_.peak_bytes = level;
    if (!explain_) return;
    prediction_.peak_during = words(during);
    prediction_.live_at_peak.clear();
    for (int kind = kFixed; kind < kBufferKinds; ++kind)
      for (size_t group = 0; group < (kind == kFixed ? 1 : model_.groups.size()); ++group) {
        const int64_t bytes = live(Buffer(kind), int(group));
        if (bytes > 0) prediction_.live_at_peak.push_back({name(Buffer(kind), int(group)), bytes});
      }
    if (extra > 0) prediction_.live_at_peak.push_back({"working memory of the " + words(during), extra});
  }

  const CostModel& model_;
  const Schedule& schedule_;
  const bool explain_;
  const int64_t bucket_limit_;  // bytes; 0: no bucketing
  Prediction prediction_;
  std::vector<int64_t> live_;  // bytes of each buffer (live())
  int64_t in_use_ = 0;
  double cpu_ = 0, compute_end_ = 0, gather_end_ = 0, reduce_end_ = 0;
  double compute_not_before_ = 0;  // the oldest reduce-scatter's end, once the cap ordered compute after it
  int pass_ = 0;  // of model_.micro_batches
  std::vector<int> forward_order_, backward_order_;
  std::vector<double> gathered_at_;             // when each group's latest all-gather ends
  std::vector<bool> unsharded_;
  std::deque<double> releases_;                 // device times of resharded groups' last uses
  std::deque<std::pair<double, std::vector<int>>> reductions_;  // (end, groups) of reduce-scatters in flight
  std::vector<int> reduce_bucket_;  // groups whose reduce-scatter waits
  int64_t reduce_bucket_bytes_ = 0;
  int reduce_bucket_waited_ = 0;  // groups that joined it after its first
  std::vector<std::pair<double, double>> collectives_;  // (start, end) of every collective issued
};

}  // namespace

Prediction simulate(const CostModel& model, const Schedule& schedule, bool explain) {
  return Replay(model, schedule, explain).run();
}

double time_within(const std::vector<std::pair<double, double>>& intervals, double from, double to) {
  double total = 0;
  for (const auto& [start, end] : intervals) total += std::max(0.0, std::min(end, to) - std::max(start, from));
  return total;
}

}  // namespace fsdp::plan
