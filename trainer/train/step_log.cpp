#include "train/step_log.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "train/args.h"

namespace fsdp::train {

RuntimeStats counted_between(const RuntimeStats& before, const RuntimeStats& after) {
  RuntimeStats d;
  d.allgather_waits = after.allgather_waits - before.allgather_waits;
  d.reduce_scatter_waits = after.reduce_scatter_waits - before.reduce_scatter_waits;
  d.host_step_waits = after.host_step_waits - before.host_step_waits;
  d.prefetches = after.prefetches - before.prefetches;
  d.order_departures = after.order_departures - before.order_departures;
  d.all_gathers = after.all_gathers - before.all_gathers;
  d.reduce_scatters = after.reduce_scatters - before.reduce_scatters;
  return d;
}

std::string eta_text(double step_ms, int steps_left) {
  const long seconds = std::lround(step_ms * steps_left / 1000.0);
  char text[32];
  if (seconds < 60)
    std::snprintf(text, sizeof(text), "%lds", seconds);
  else if (seconds < 3600)
    std::snprintf(text, sizeof(text), "%ldm%02lds", seconds / 60, seconds % 60);
  else
    std::snprintf(text, sizeof(text), "%ldh%02ldm", seconds / 3600, seconds % 3600 / 60);
  return text;
}

namespace {

// What a log file already holds: its lines and the last run mark among them.
struct LoggedRuns {
  int lines = 0, first_step = 0, last_step = 0;
  std::string last_run;  // "" where no line records a run (a log of another program, or not a log)
};

LoggedRuns logged_runs(const std::string& path) {
  LoggedRuns found;
  std::ifstream in(path);
  for (std::string text; std::getline(in, text);) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++found.lines;
    const auto line = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!line.is_object()) continue;
    if (line.contains("run") && line["run"].is_string()) found.last_run = line["run"];
    if (line.contains("step") && line["step"].is_number_integer()) {
      found.last_step = line["step"];
      if (!found.first_step) found.first_step = found.last_step;
    }
  }
  return found;
}

}  // namespace

StepLog::StepLog(const std::string& path, const LogOwner& owner, int print_every)
    : owner_(owner), print_every_(print_every) {
  const std::string dir = io::parent_of(path);
  if (!io::is_directory(dir)) io::make_directories(dir);  // the default runs/<date-time>-<run>/
  file_ = io::LockedFile::open(path);
  if (!file_)
    throw UsageError("--log: '" + path + "' is being written by another run (it holds the file's lock): give this "
                     "run a --log of its own");
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) return;  // new, empty, a pipe
  if (owner.overwrite) {
    file_->rewrite("");
    return;
  }
  const LoggedRuns found = logged_runs(path);
  if (owner.resumed_from && !found.last_run.empty() && found.last_run == owner.run) return;  // this lineage's log
  const std::string holds =
      found.last_step ? "steps " + std::to_string(found.first_step) + "-" + std::to_string(found.last_step) +
                            (found.last_run.empty() ? "" : " of run " + found.last_run)
                      : std::to_string(found.lines) + " lines that are no step log";
  throw UsageError("--log: '" + path + "' already holds " + holds + (owner.resumed_from ? ", not of the run this "
                   "checkpoint continues (" + owner.run + ")" : "") + "; a log is never emptied: --resume a "
                   "checkpoint of its run to append to it, pass --overwrite-log to replace it, or give another --log");
}

void StepLog::add_writer(const MetricsWriter& writer, const std::string& target,
                         const std::vector<std::string>& options) {
  writers_.push_back(std::make_unique<MetricsBridge>(writer, target, options));
}

void StepLog::write(const StepRecord& r) {
  const double tok_s = r.tokens_per_step / (r.ms / 1000.0);
  const MemoryPeaks& mem = r.memory;
  // The time left at the mean of the last 20 steps; the run's first step (its start-up in it)
  // counts only until a second comes.
  if (recent_ms_.size() == 1 && !dropped_first_) {
    recent_ms_.clear();
    dropped_first_ = true;
  }
  recent_ms_.push_back(r.ms);
  if (recent_ms_.size() > 20) recent_ms_.pop_front();
  if (!printed_ || r.step % print_every_ == 0 || r.step == r.steps || r.skipped || r.eval) {
    printed_ = true;
    std::printf("step %4d/%d | loss %.4f | lr %.2e", r.step, r.steps, r.loss, r.lr);
    if (r.grad_norm) std::printf(" | grad norm %.3f", *r.grad_norm);
    std::printf(" | %8.0f tok/s | %7.1f ms | %s %.2f", tok_s, r.ms, r.on_gpu ? "peak alloc/reserved" : "peak rss",
                mem.allocated_gib);
    if (r.on_gpu) std::printf("/%.2f", mem.reserved_gib);
    std::printf(" GiB | waits ag %ld rs %ld", r.waits.allgather_waits, r.waits.reduce_scatter_waits);
    if (r.shows_host_steps) std::printf(" host steps %ld", r.waits.host_step_waits);
    if (r.step < r.steps) {
      double sum = 0;
      for (double ms : recent_ms_) sum += ms;
      std::printf(" | eta %s", eta_text(sum / recent_ms_.size(), r.steps - r.step).c_str());
    }
    std::printf("\n");
  }
  if (r.eval)
    std::printf("eval after step %d | loss %.4f | perplexity %.2f | %lld tokens\n", r.step, r.eval->loss,
                r.eval->perplexity, (long long)r.eval->tokens);
  std::fflush(stdout);
  // The JSON library writes a number that is not finite (a diverged loss, a failed memory sample)
  // as null, and escapes any text (a model path with quotes).
  nlohmann::ordered_json line = {{"step", r.step},
                         {"loss", r.loss},
                         {"lr", r.lr},
                         {"grad_norm", r.grad_norm ? nlohmann::ordered_json(*r.grad_norm) : nlohmann::ordered_json()},
                         {"skipped", r.skipped},
                         {"tok_s", tok_s},
                         {"step_ms", r.ms},
                         {"peak_alloc_gib", mem.allocated_gib},
                         {"peak_reserved_gib", mem.reserved_gib},
                         {"peak_active_gib", mem.active_gib},
                         {"alloc_retries", mem.alloc_retries},
                         {"allgather_waits", r.waits.allgather_waits},
                         {"reduce_scatter_waits", r.waits.reduce_scatter_waits},
                         {"host_step_waits", r.waits.host_step_waits},
                         {"prefetches", r.waits.prefetches},
                         {"tokens_per_step", r.tokens_per_step},
                         {"flops_per_token", r.flops_per_token},
                         {"alloc_end_bytes", mem.allocated_now_bytes},
                         {"reserved_end_bytes", mem.reserved_now_bytes},
                         {"rss_gib", mem.rss_now_gib},
                         {"world", r.world},
                         {"model", r.model}};
  line["samples"] = r.samples;
  if (r.epoch_samples > 0) line["epoch"] = double(r.samples) / double(r.epoch_samples);  // 1.5: halfway through the second
  if (r.eval) {
    line["eval_loss"] = r.eval->loss;
    line["eval_ppl"] = r.eval->perplexity;
  }
  if (!marked_) {  // the run mark: whose lines follow, and from which checkpoint
    marked_ = true;
    line["run"] = owner_.run;
    if (owner_.resumed_from) line["resumed_from"] = *owner_.resumed_from;
  }
  const std::string text = line.dump();
  file_->write(text + "\n");
  for (auto& bridge : writers_) bridge->send(text);
}

std::string StepLog::close_writers() {
  std::string wrote;
  for (auto& bridge : writers_) {
    const std::string error = bridge->close();
    if (error.empty())
      wrote += ", " + bridge->wrote();
    else
      std::fprintf(stderr, "fsdp-train: warning: %s\n", error.c_str());
  }
  return wrote;
}

}  // namespace fsdp::train
