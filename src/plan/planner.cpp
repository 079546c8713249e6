#include "fsdp/plan/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace fsdp::plan {
namespace {

// Checkpointable groups, those that free the most activation bytes per ms of recompute first.
std::vector<size_t> recompute_order(const CostModel& model) {
  std::vector<size_t> order;
  for (size_t g = 0; g < model.groups.size(); ++g)
    if (model.groups[g].recomputable) order.push_back(g);
  auto gain = [&](size_t g) {
    const auto& c = model.groups[g];
    return double(c.saved_bytes - c.recompute_saved_bytes) / std::max(c.forward_ms + c.tp_comm_ms, 1e-6);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return gain(a) > gain(b); });
  return order;
}

// How many of the last groups to keep unsharded: 0, 1, 2, 4, ... up to all.
std::vector<size_t> kept_unsharded_counts(size_t groups) {
  std::vector<size_t> counts{0};
  for (size_t m = 1; m < groups; m *= 2) counts.push_back(m);
  if (groups > 0) counts.push_back(groups);
  return counts;
}

// The first four of `items`, then ", ..." if there are more.
std::string first_few(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < 4; ++i) out += (i ? ", " : "") + items[i];
  return items.size() > 4 ? out + ", ..." : out;
}

std::string names(const std::vector<bool>& chosen, const CostModel& model, bool value) {
  std::vector<std::string> items;
  for (size_t g = 0; g < chosen.size(); ++g)
    if (chosen[g] == value) items.push_back(model.groups[g].name);
  return first_few(items);
}

// The groups whose own prefetch depth differs from the runtime's, as "blocks.3 2, ...".
std::string own_depths(const Schedule& s, const CostModel& model) {
  std::vector<std::string> items;
  for (size_t g = 0; g < s.prefetch_depth.size(); ++g)
    if (s.prefetch_depth_of(g) != s.runtime.prefetch_depth)
      items.push_back(model.groups[g].name + " " + std::to_string(s.prefetch_depth[g]));
  return first_few(items);
}

constexpr int kDeepestPrefetch = 4;

// Deeper prefetch for single groups, one at a time while it helps: a group whose compute is
// short beside the all-gathers after it (a heavy head, uneven blocks) hides them only if they
// start earlier. A deepening must save more than a thousandth of the step and still fit.
Planned deepen_prefetch(const CostModel& model, Planned best, int64_t usable) {
  const size_t n = model.groups.size();
  if (best.schedule.prefetch_depth.empty()) best.schedule.prefetch_depth.assign(n, -1);
  for (bool improved = true; improved;) {
    improved = false;
    for (size_t g = 0; g < n; ++g) {
      Schedule s = best.schedule;
      const int depth = s.prefetch_depth_of(g) + 1;
      if (depth > kDeepestPrefetch) continue;
      s.prefetch_depth[g] = depth;
      Prediction p = simulate(model, s, /*explain=*/false);
      if (p.peak_bytes <= usable && p.step_ms < best.prediction.step_ms * (1 - 1e-3)) {
        best = {std::move(s), std::move(p)};
        improved = true;
      }
    }
  }
  return best;
}

}  // namespace

std::vector<double> bucket_sizes_mb(const CostModel& model) {
  std::vector<double> sizes{0};
  if (model.allgather_latency_ms <= 0 && model.reduce_scatter_latency_ms <= 0) return sizes;
  int64_t smallest = 0;
  for (const auto& g : model.groups)
    if (g.memory.param_bytes > 0 && (smallest == 0 || g.memory.param_bytes < smallest)) smallest = g.memory.param_bytes;
  // Half a group above a multiple, so that equal groups fill a bucket whatever their rounding.
  for (double groups : {2.5, 4.5})
    if (smallest > 0) sizes.push_back(double(smallest) * groups / (1024.0 * 1024.0));
  return sizes;
}

std::string format_bytes(int64_t bytes) {
  char text[32];
  if (bytes >= (int64_t(1) << 30))
    std::snprintf(text, sizeof(text), "%.2f GiB", bytes / double(int64_t(1) << 30));
  else
    std::snprintf(text, sizeof(text), "%.1f MiB", bytes / double(1 << 20));
  return text;
}

std::string describe(const Schedule& s, const CostModel& model) {
  const auto count = [](const std::vector<bool>& v, bool value) { return std::count(v.begin(), v.end(), value); };
  const auto cap = [](int c) { return c == 0 ? std::string("unlimited") : std::to_string(c); };
  const long recomputed = count(s.recompute, true), kept = count(s.reshard_after_forward, false);
  std::string text = "recompute " + std::to_string(recomputed) + " of " + std::to_string(s.recompute.size());
  if (recomputed > 0) text += " (" + names(s.recompute, model, true) + ")";
  text += ", " + std::to_string(kept) + " kept unsharded";
  if (kept > 0) text += " (" + names(s.reshard_after_forward, model, false) + ")";
  const RuntimeOptions& r = s.runtime;
  const std::string deeper = own_depths(s, model);
  text += ", prefetch " + std::to_string(r.prefetch_depth) + (deeper.empty() ? "" : " (" + deeper + ")") +
          ", in flight " + cap(r.max_inflight_allgathers) + " all-gathers / " + cap(r.max_inflight_reduce_scatters) +
          " reduce-scatters";
  if (r.bucket_mb > 0) {
    text += ", buckets of " + format_bytes(static_cast<int64_t>(r.bucket_bytes()));
    if (r.reduce_bucket_max_wait > 0) text += " waiting at most " + std::to_string(r.reduce_bucket_max_wait) + " groups";
  }
  return text;
}

Plan plan_schedule(const CostModel& model, int64_t budget_bytes, double margin) {
  if (!(margin >= 0 && margin < 1)) throw std::invalid_argument("plan: the margin must be in [0, 1)");
  const size_t n = model.groups.size();
  const auto usable = static_cast<int64_t>(std::floor(double(budget_bytes) * (1 - margin)));
  const auto order = recompute_order(model);
  const auto buckets = bucket_sizes_mb(model);
  std::vector<Planned> fits;
  int64_t smallest_peak = std::numeric_limits<int64_t>::max();
  Schedule s = default_schedule(n);
  for (size_t k = 0; k <= order.size(); ++k) {
    std::fill(s.recompute.begin(), s.recompute.end(), false);
    for (size_t i = 0; i < k; ++i) s.recompute[order[i]] = true;
    for (size_t m : kept_unsharded_counts(n)) {
      for (size_t g = 0; g < n; ++g) s.reshard_after_forward[g] = g < n - m && !model.groups[g].encloses_later;
      for (int depth : {0, 1, 2})
        for (int gathers : {1, 2, 0})
          for (int reductions : {1, 2, 0})
            for (double bucket_mb : buckets)
              for (int max_wait : {0, 1}) {
                if (bucket_mb == 0 && max_wait > 0) continue;  // the wait applies to buckets only
                s.runtime.prefetch_depth = depth;
                s.runtime.max_inflight_allgathers = gathers;
                s.runtime.max_inflight_reduce_scatters = reductions;
                s.runtime.bucket_mb = bucket_mb;
                s.runtime.reduce_bucket_max_wait = max_wait;
                Prediction p = simulate(model, s, /*explain=*/false);
                smallest_peak = std::min(smallest_peak, p.peak_bytes);
                if (p.peak_bytes <= usable) fits.push_back({s, std::move(p)});
              }
    }
  }
  if (fits.empty()) {
    const auto smallest_budget = static_cast<int64_t>(std::ceil(double(smallest_peak) / (1 - margin)));
    throw BudgetTooSmall("a memory budget of " + format_bytes(budget_bytes) +
                             " is too small: the schedule with the least memory peaks at " +
                             format_bytes(smallest_peak) + ", so the smallest budget that fits is " +
                             format_bytes(smallest_budget) + " (with the " + std::to_string(int(margin * 100)) +
                             "% margin); use more GPUs, CPU offload, a smaller batch or sequence",
                         smallest_budget);
  }
  std::stable_sort(fits.begin(), fits.end(), [](const Planned& a, const Planned& b) {
    if (a.prediction.step_ms != b.prediction.step_ms) return a.prediction.step_ms < b.prediction.step_ms;
    return a.prediction.peak_bytes < b.prediction.peak_bytes;
  });
  Plan plan{deepen_prefetch(model, fits.front(), usable), {}, usable};
  // Runners-up that predict something else than the choice and each other (many schedules differ
  // only in a cap that changes nothing).
  for (size_t i = 1; i < fits.size() && plan.runners_up.size() < 3; ++i) {
    const auto& p = fits[i].prediction;
    const auto same = [&](const Planned& other) {
      return other.prediction.step_ms == p.step_ms && other.prediction.peak_bytes == p.peak_bytes;
    };
    if (!same(plan.chosen) && std::none_of(plan.runners_up.begin(), plan.runners_up.end(), same))
      plan.runners_up.push_back(fits[i]);
  }
  // The search replayed without explanations; the answers get theirs.
  plan.chosen.prediction = simulate(model, plan.chosen.schedule);
  for (Planned& p : plan.runners_up) p.prediction = simulate(model, p.schedule);
  return plan;
}

}  // namespace fsdp::plan
