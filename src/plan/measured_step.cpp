#include "fsdp/plan/measured_step.h"

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

#include "fsdp/plan/simulator.h"

namespace fsdp::plan {

Schedule profiling_schedule(const std::vector<GroupShape>& groups) {
  Schedule s = uniform_schedule(groups, /*recomputed=*/true);
  s.runtime.prefetch_depth = 0;
  return s;
}

namespace {

class Measure {
 public:
  explicit Measure(const RecordedStep& step) : step_(step) {}

  const RecordedSpan* find(const std::string& name, int occurrence = 0) const {
    for (const auto& span : step_.spans)
      if (span.name == name && occurrence-- == 0) return &span;
    return nullptr;
  }
  const RecordedSpan& get(const std::string& name, int occurrence = 0) const {
    const RecordedSpan* span = find(name, occurrence);
    if (!span)
      throw std::invalid_argument("profiled step: no span '" + name + "'" +
                                  (occurrence ? " (occurrence " + std::to_string(occurrence + 1) + ")" : "") +
                                  "; was it recorded under plan::profiling_schedule, bucketing off?");
    if (span->start_mark < 0 || span->end_mark < 0 || span->end_mark >= static_cast<int>(step_.marks.size()))
      throw std::invalid_argument("profiled step: span '" + name + "' has no memory marks");
    return *span;
  }

  int64_t allocated(int mark) const { return step_.marks.at(mark).allocated; }
  // The most allocated after mark `from` up to mark `to`.
  int64_t peak(int from, int to) const {
    int64_t most = allocated(from);
    for (int i = from + 1; i <= to; ++i) most = std::max(most, step_.marks.at(i).peak_since_last);
    return most;
  }
  double device_ms(const RecordedSpan& s) const { return s.end_ms - s.start_ms; }
  double host_ms(const RecordedSpan& s) const { return s.host_end_ms - s.host_start_ms; }

  // The mean device (or host) time of the spans so named: a group's all-gathers, its
  // reduce-scatter, its hand-off; 0 without one.
  double mean_ms(const std::string& name, bool host = false) const {
    double total = 0;
    int count = 0;
    for (const auto& span : step_.spans)
      if (span.name == name) total += host ? host_ms(span) : device_ms(span), ++count;
    return count ? total / count : 0.0;
  }

 private:
  const RecordedStep& step_;
};

// A group that is not the root: each of its phases is a span of its own.
void measure_group(const Measure& m, const GroupShape& shape, GroupCost& cost) {
  const RecordedSpan& forward = m.get("forward " + shape.label);
  const RecordedSpan& backward = m.get("backward " + shape.label);
  const int64_t forward_delta = m.allocated(forward.end_mark) - m.allocated(forward.start_mark);
  cost.forward_ms = m.device_ms(forward);
  cost.forward_cpu_ms = m.host_ms(forward);
  if (shape.recomputable) {
    const RecordedSpan& recompute = m.get("recompute " + shape.label);
    cost.recompute_saved_bytes = forward_delta;
    cost.saved_bytes = m.allocated(recompute.end_mark) - m.allocated(recompute.start_mark);
    cost.forward_peak_bytes = m.peak(recompute.start_mark, recompute.end_mark) - m.allocated(recompute.start_mark);
    cost.forward_ms = m.device_ms(recompute);  // with autograd saving, as in a forward that is not recomputed
    cost.forward_cpu_ms = m.host_ms(recompute);
  } else {
    cost.saved_bytes = cost.recompute_saved_bytes = forward_delta;
    cost.forward_peak_bytes = m.peak(forward.start_mark, forward.end_mark) - m.allocated(forward.start_mark);
  }
  cost.backward_ms = m.device_ms(backward);
  cost.backward_cpu_ms = m.host_ms(backward);
  cost.backward_peak_bytes = m.peak(backward.start_mark, backward.end_mark) - m.allocated(backward.start_mark);
}

// The root: its forward span holds the others' (its own part is before the first and after the
// last), its backward span too (its head's backward before the last group's, its embedding's
// after the first group's hand-off). The all-gathers the compute stream waited for inside are not
// its own.
void measure_root(const Measure& m, const std::vector<GroupShape>& groups, GroupCost& cost) {
  const GroupShape& root = groups.front();
  const GroupShape& first = groups[1];
  const GroupShape& last = groups.back();
  const RecordedSpan& forward = m.get("forward " + root.label);
  const RecordedSpan& backward = m.get("backward " + root.label);
  const RecordedSpan& first_forward = m.get("forward " + first.label);
  const RecordedSpan& last_forward = m.get("forward " + last.label);
  const RecordedSpan& first_gather = m.get("all-gather " + first.label, 0);
  const RecordedSpan& last_gather = m.get("all-gather " + last.label, 1);  // its backward's
  const RecordedSpan& last_backward_start = m.find("recompute " + last.label) ? m.get("recompute " + last.label)
                                                                            : m.get("backward " + last.label);
  const RecordedSpan& first_backward = m.get("backward " + first.label);
  const RecordedSpan* first_handoff = m.find("hand-off " + first.label);  // the first group's own
  // Marks: before the first group's all-gather allocates, after the last group's reshard, before
  // the last group's all-gather in backward.
  const int embed_end = first_gather.start_mark - 1, head_start = last_forward.end_mark + 1;
  const int head_backward_end = last_gather.start_mark - 1;

  const int64_t embed_saved = m.allocated(embed_end) - m.allocated(forward.start_mark);
  const int64_t head_saved = m.allocated(forward.end_mark) - m.allocated(head_start);
  // Between the root's forward and its backward, the loss when the model does not compute it
  // (a Python training step's cross-entropy over float32 logits): its peak, and what it leaves
  // for backward (the logits' gradient), count as the head's.
  const int64_t loss_peak = m.peak(forward.end_mark, backward.start_mark) - m.allocated(forward.end_mark);
  const int64_t loss_kept = m.allocated(backward.start_mark) - m.allocated(forward.end_mark);
  cost.saved_bytes = cost.recompute_saved_bytes = embed_saved + head_saved + std::max<int64_t>(0, loss_kept);
  cost.forward_peak_bytes = std::max({m.peak(forward.start_mark, embed_end) - m.allocated(forward.start_mark),
                                      embed_saved + m.peak(head_start, forward.end_mark) - m.allocated(head_start),
                                      embed_saved + head_saved + loss_peak});
  // The embedding's backward comes when the blocks' memory is gone: only the head's counts.
  cost.backward_peak_bytes = m.peak(backward.start_mark, head_backward_end) - m.allocated(backward.start_mark);
  for (bool host : {false, true}) {
    const auto at = [host](const RecordedSpan& s, bool end) {
      return host ? (end ? s.host_end_ms : s.host_start_ms) : (end ? s.end_ms : s.start_ms);
    };
    const auto length = [&](const RecordedSpan& s) { return at(s, true) - at(s, false); };
    const double embed = at(first_forward, false) - at(forward, false) - length(first_gather);
    const double head = at(forward, true) - at(last_forward, true);
    const double head_backward = at(last_backward_start, false) - at(backward, false) - length(last_gather);
    const double embed_backward =
        at(backward, true) - at(first_backward, true) - (first_handoff ? length(*first_handoff) : 0.0);
    (host ? cost.forward_cpu_ms : cost.forward_ms) = std::max(0.0, embed) + std::max(0.0, head);
    (host ? cost.backward_cpu_ms : cost.backward_ms) = std::max(0.0, head_backward) + std::max(0.0, embed_backward);
  }
}

// fixed_ms: what the profiled step took beyond the groups' replay under `profiled`.
void fit_fixed_ms(CostModel& model, const Schedule& profiled) {
  model.fixed_ms = 0;
  model.fixed_ms = std::max(0.0, model.profiled_step_ms - simulate(model, profiled).step_ms);
}

}  // namespace

CostModel measure_cost_model(const std::vector<GroupShape>& groups, const RecordedStep& step) {
  if (step.marks.empty()) throw std::invalid_argument("profiled step: recorded without memory marks");
  for (size_t g = 0; g < groups.size(); ++g)
    if (groups[g].encloses_later && (g != 0 || groups.size() < 2))
      throw std::invalid_argument("profiled step: only the first of two or more groups can be the root (" +
                                  groups[g].name + ")");
  const Measure m(step);
  if (step.micro_batches < 1)
    throw std::invalid_argument("profiled step: " + std::to_string(step.micro_batches) + " micro-batches");
  CostModel model;
  model.micro_batches = step.micro_batches;
  model.reduce_every_micro_batch = step.reduce_every_micro_batch;
  model.fixed_bytes = step.marks.front().allocated;
  for (const auto& mark : step.marks)
    model.profiled_peak_bytes = std::max(model.profiled_peak_bytes, mark.peak_since_last);
  for (const auto& shape : groups) {
    GroupCost cost;
    cost.name = shape.name;
    cost.memory = shape.memory;
    cost.recomputable = shape.recomputable;
    cost.encloses_later = shape.encloses_later;
    cost.allgather_ms = m.mean_ms("all-gather " + shape.label);
    cost.reduce_scatter_ms = m.mean_ms("reduce-scatter " + shape.label);
    cost.handoff_ms = m.mean_ms("hand-off " + shape.label);
    cost.handoff_cpu_ms = m.mean_ms("hand-off " + shape.label, /*host=*/true);
    if (shape.encloses_later)
      measure_root(m, groups, cost);
    else
      measure_group(m, shape, cost);
    for (int64_t* bytes : {&cost.saved_bytes, &cost.recompute_saved_bytes, &cost.forward_peak_bytes,
                           &cost.backward_peak_bytes})
      *bytes = std::max<int64_t>(0, *bytes);
    if (step.host_is_device) cost.forward_cpu_ms = cost.backward_cpu_ms = cost.handoff_cpu_ms = 0;  // one clock
    model.groups.push_back(std::move(cost));
  }
  if (model.micro_batches > 1)  // the last pass began with the earlier passes' gradients
    for (const auto& g : model.groups)
      model.fixed_bytes -= model.reduce_every_micro_batch ? g.memory.sharded_grad_bytes : g.memory.unsynced_grad_bytes;
  model.profiled_step_ms = step.step_ms;
  fit_fixed_ms(model, profiling_schedule(groups));
  return model;
}

Schedule calibration_schedule(const std::vector<GroupShape>& groups) {
  Schedule s = profiling_schedule(groups);
  s.runtime.prefetch_depth = 1;
  return s;
}

void calibrate_contention(CostModel& model, const std::vector<GroupShape>& groups, const RecordedStep& step) {
  if (groups.size() != model.groups.size())
    throw std::invalid_argument("calibration step: " + std::to_string(groups.size()) + " groups, the profile has " +
                                std::to_string(model.groups.size()));
  // The blocks' compute (the root's spans enclose everything), and each collective's time alone.
  std::set<std::string> compute_names;
  std::map<std::string, double> alone;
  for (size_t g = 0; g < groups.size(); ++g) {
    alone["all-gather " + groups[g].label] = model.groups[g].allgather_ms;
    alone["reduce-scatter " + groups[g].label] = model.groups[g].reduce_scatter_ms;
    if (groups[g].encloses_later) continue;
    for (const char* phase : {"forward ", "recompute ", "backward ", "hand-off "})
      compute_names.insert(phase + groups[g].label);
  }
  std::vector<std::pair<double, double>> compute;
  for (const auto& span : step.spans)
    if (compute_names.count(span.name)) compute.emplace_back(span.start_ms, span.end_ms);
  // Per kind of collective: the time of those at least half beside compute, and their time alone.
  std::map<std::string, std::pair<double, double>> beside;
  int gathers = 0;
  for (const auto& span : step.spans) {
    const auto it = alone.find(span.name);
    if (it == alone.end()) continue;
    const double overlap = time_within(compute, span.start_ms, span.end_ms);
    const std::string kind = span.name.substr(0, span.name.find(' '));
    gathers += kind == "all-gather";
    if (overlap * 2 >= span.end_ms - span.start_ms) {
      beside[kind].first += span.end_ms - span.start_ms;
      beside[kind].second += it->second;
    }
  }
  if (gathers == 0)
    throw std::invalid_argument("calibration step: no all-gather of the profiled groups was recorded; record it "
                                "with the trace on, under plan::calibration_schedule");
  const auto stretch = [&](const std::string& kind) {
    const auto [together, apart] = beside[kind];
    return apart > 0 ? std::max(1.0, together / apart) : 1.0;
  };
  model.contention.allgather_stretch = stretch("all-gather");
  model.contention.reduce_scatter_stretch = stretch("reduce-scatter");

  // The replay's time grows with the slowdown: bisect for the measured time.
  const Schedule calibrated = calibration_schedule(groups), profiled = profiling_schedule(groups);
  const auto replay_ms = [&](double slowdown) {
    model.contention.compute_slowdown = slowdown;
    fit_fixed_ms(model, profiled);
    return simulate(model, calibrated).step_ms;
  };
  double low = 0, high = 4;
  if (replay_ms(low) >= step.step_ms) {
    high = low;
  } else if (replay_ms(high) <= step.step_ms) {
    low = high;
  }
  while (high - low > 1e-4) {
    const double middle = (low + high) / 2;
    (replay_ms(middle) < step.step_ms ? low : high) = middle;
  }
  replay_ms((low + high) / 2);
}

}  // namespace fsdp::plan
