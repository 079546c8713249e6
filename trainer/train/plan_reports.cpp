#include "train/plan_reports.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <stdexcept>

#include "fsdp/planning.h"
#include "fsdp/memory_stats.h"
#include "train/memory.h"
#include "train/llama_schedule.h"

namespace fsdp::train {
namespace {

using plan::format_bytes;

std::string prediction_text(const plan::Prediction& p) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.1f ms/step, peak ", p.step_ms);
  return text + format_bytes(p.peak_bytes);
}

std::string recomputed_blocks_json(const plan::Schedule& s) {
  std::string out = "[";
  for (size_t g = 1; g < s.recompute.size(); ++g)
    if (s.recompute[g]) out += (out.size() > 1 ? "," : "") + std::to_string(g - 1);
  return out + "]";
}

}  // namespace

std::string profile_report(const plan::CostModel& profile, const plan::Schedule& profiled) {
  const plan::Prediction replay = plan::simulate(profile, profiled);
  char latency[160];
  std::snprintf(latency, sizeof(latency), "; a collective's latency (what a bucket saves per group): all-gather "
                "%.3f ms, reduce-scatter %.3f ms\n", profile.allgather_latency_ms, profile.reduce_scatter_latency_ms);
  return "fsdp-train: profiled step: peak " + format_bytes(profile.profiled_peak_bytes) +
         " allocated (the simulator's replay: " + format_bytes(replay.peak_bytes) + "); " +
         format_bytes(profile.fixed_bytes) + " held throughout (shards, optimizer state)" + latency;
}

std::string contention_report(const plan::CostModel& profile, const plan::Schedule& calibrated) {
  plan::CostModel alone = profile;
  alone.contention = plan::Contention{};
  const auto& c = profile.contention;
  char text[400];
  std::snprintf(text, sizeof(text),
                "fsdp-train: calibration step (prefetch 1): replayed in %.1f ms (%.1f ms if collectives beside "
                "compute cost nothing): beside compute all-gathers take %.2fx their time alone, reduce-scatters "
                "%.2fx, and compute loses %.2f ms per ms of collective beside it\n",
                plan::simulate(profile, calibrated).step_ms, plan::simulate(alone, calibrated).step_ms,
                c.allgather_stretch, c.reduce_scatter_stretch, c.compute_slowdown);
  return text;
}

std::string plan_report(const plan::Plan& plan, const plan::CostModel& profile, int64_t budget_bytes) {
  std::string text = "fsdp-train: plan for a " + format_bytes(budget_bytes) + " budget (" +
                     format_bytes(plan.usable_bytes) + " usable): " + describe(plan.chosen.schedule, profile) +
                     "\nfsdp-train:   predicted " + prediction_text(plan.chosen.prediction) + " (during the " +
                     plan.chosen.prediction.peak_during + ": ";
  const auto& live = plan.chosen.prediction.live_at_peak;
  for (size_t i = 0; i < live.size() && i < 4; ++i)
    text += (i ? ", " : "") + live[i].what + " " + format_bytes(live[i].bytes);
  text += live.size() > 4 ? ", ...)\n" : ")\n";
  for (const auto& r : plan.runners_up)
    text += "fsdp-train:   runner-up: " + describe(r.schedule, profile) + ": " + prediction_text(r.prediction) + "\n";
  return text;
}

void check_plans(model::Llama& model, const plan::CostModel& profile, const std::function<void()>& one_step,
                 const c10::Device& device, const PlanCheck& check, bool lead) {
  if (check.steps < 3) throw std::invalid_argument("--plan-check-steps must be at least 3 (two are warm-up)");
  if (check.rounds < 1) throw std::invalid_argument("--plan-check-rounds must be at least 1");
  struct Candidate {
    std::string name;
    plan::Schedule schedule;
    int64_t budget_bytes = 0;  // 0: a fixed point, not planned
    std::vector<std::vector<double>> times;  // per round, the measured steps
    int64_t peak = 0;
  };
  const Candidate none{"no recomputation", plan::uniform_schedule(profile.groups, false), 0, {}, 0};
  std::vector<Candidate> listed{{"full recomputation", plan::uniform_schedule(profile.groups, true), 0, {}, 0}};
  const int64_t low = plan::simulate(profile, listed[0].schedule).peak_bytes;
  const int64_t high = plan::simulate(profile, none.schedule).peak_bytes;
  for (int i = 0; i < check.budgets; ++i) {
    // Budgets whose usable part (less the 5% margin) runs from the low peak to the high one.
    const double usable = low + (high - low) * double(i) / std::max(1, check.budgets - 1);
    const auto budget = static_cast<int64_t>(usable / 0.95) + 1;
    try {
      const plan::Schedule chosen = plan::plan_schedule(profile, budget).chosen.schedule;
      listed.push_back({"planned for " + format_bytes(budget), chosen, budget, {}, 0});
    } catch (const plan::BudgetTooSmall&) {
    }
  }
  listed.push_back(none);
  // And no recomputation with each bucket size the planner tries: the buckets' own predictions.
  for (double mb : plan::bucket_sizes_mb(profile)) {
    if (mb == 0) continue;
    Candidate bucketed = none;
    bucketed.schedule.runtime.bucket_mb = mb;
    bucketed.name = "no recomputation, buckets of " + format_bytes(bucketed.schedule.runtime.bucket_bytes());
    listed.push_back(std::move(bucketed));
  }
  std::vector<Candidate> runs;
  for (auto& c : listed) {
    const bool repeated =
        std::any_of(runs.begin(), runs.end(), [&](const auto& r) { return r.schedule == c.schedule; });
    const bool too_large = check.device_bytes > 0 &&
                           plan::simulate(profile, c.schedule).peak_bytes > 0.95 * check.device_bytes;
    if (!repeated && !too_large) runs.push_back(std::move(c));
  }
  std::ofstream out;
  if (lead) {
    out.open(check.path);
    if (!out) throw std::runtime_error("--plan-check: cannot write '" + check.path + "'");
  }
  // Rounds in alternating order (least memory first, then back): a drift over the run (the GPU's
  // clocks under sustained load, the allocator's pool) reaches every schedule alike instead of
  // favouring those measured first.
  for (int round = 0; round < check.rounds; ++round) {
    for (size_t k = 0; k < runs.size(); ++k) {
      Candidate& c = runs[round % 2 == 0 ? k : runs.size() - 1 - k];
      apply_schedule(model, c.schedule);
      c.times.emplace_back();
      for (int i = 0; i < check.steps; ++i) {
        if (i == 2) reset_peak_allocated(device);
        const auto start = std::chrono::steady_clock::now();
        one_step();  // ends with the device idle
        const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
        if (i >= 2) c.times.back().push_back(elapsed.count());
      }
      c.peak = std::max(c.peak, allocated_bytes(device).peak);
    }
  }
  if (!lead) return;
  const auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  for (const auto& c : runs) {
    const plan::Prediction predicted = plan::simulate(profile, c.schedule);
    std::vector<double> all;
    std::string rounds = "[";
    for (const auto& t : c.times) {
      all.insert(all.end(), t.begin(), t.end());
      rounds += (rounds.size() > 1 ? "," : "") + std::to_string(median(t));
    }
    const double measured = median(all);
    std::printf("fsdp-train: plan check: %s: %s | predicted %.1f ms, %s | measured %.1f ms, %s\n", c.name.c_str(),
                describe(c.schedule, profile).c_str(), predicted.step_ms, format_bytes(predicted.peak_bytes).c_str(),
                measured, format_bytes(c.peak).c_str());
    out << "{\"name\":\"" << c.name << "\",\"schedule\":\"" << describe(c.schedule, profile)
        << "\",\"recomputed_blocks\":" << recomputed_blocks_json(c.schedule)
        << ",\"budget_bytes\":" << c.budget_bytes
        << ",\"predicted_ms\":" << predicted.step_ms << ",\"predicted_peak_bytes\":" << predicted.peak_bytes
        << ",\"measured_ms\":" << measured << ",\"round_ms\":" << rounds << "]"
        << ",\"measured_peak_bytes\":" << c.peak << "}" << std::endl;
  }
  std::fflush(stdout);
  if (!out.flush()) throw std::runtime_error("--plan-check: could not write '" + check.path + "'");
}

}  // namespace fsdp::train
