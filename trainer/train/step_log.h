// What fsdp-train reports of each step: the line rank 0 prints and the JSON line it appends to the
// log (tests/trainer/check_train_log.py, bench/run_bench.py and bench/memreport.py read those fields).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/runtime_options.h"
#include "io/files.h"
#include "train/evaluate.h"
#include "train/memory.h"
#include "train/metrics_bridge.h"

namespace fsdp::train {

struct StepRecord {
  int step = 0, steps = 0;  // the step done (from 1) and the run's --steps
  double loss = 0, lr = 0;
  std::optional<double> grad_norm;  // none with --clip 0
  bool skipped = false;             // --max-skipped-steps: no optimizer step
  double ms = 0;
  int64_t tokens_per_step = 0;
  int64_t samples = 0;        // sequences trained on, this step's included (the data's position)
  int64_t epoch_samples = 0;  // sequences in one pass over the data; 0: synthetic, without end
  double flops_per_token = 0;
  MemoryPeaks memory;
  RuntimeStats waits;          // the step's counts (the difference of two readings)
  bool on_gpu = false;         // the line shows reserved memory and the allocator's peaks
  bool shows_host_steps = false;  // --cpu-offload --optimizer-in-backward: the host worker's waits
  int world = 1;
  std::string model;
  std::optional<EvalResult> eval;
};

// What the runtime counted between two readings of fsdp::runtime_stats().
RuntimeStats counted_between(const RuntimeStats& before, const RuntimeStats& after);

// How long the rest of a run takes at `step_ms` a step, as a progress line shows it: "45s",
// "3m12s", "2h05m".
std::string eta_text(double step_ms, int steps_left);

// Whose steps a log takes: the run writing it and, for a resumed run, the step it resumed from.
struct LogOwner {
  std::string run;                  // the lineage's id (lineage.h)
  std::optional<int> resumed_from;  // the step of the checkpoint a resumed run continues
  bool overwrite = false;           // --overwrite-log: an existing log is emptied first
};

// The JSONL log (rank 0), held under an exclusive lock for the run (io::LockedFile): two runs
// given one --log never interleave their lines. A log is never emptied unless `owner.overwrite`:
// a new or empty file is this run's; one holding lines is appended to only by a resumed run of the
// lineage whose id its last run mark records, any other run is refused (UsageError). The first line
// a run writes carries "run" (its id) and, resumed, "resumed_from" (the checkpoint's step): the
// lines after such a mark replace those of the same steps before it. Throws naming the file when
// it cannot be written, and UsageError when another run is writing it.
class StepLog {
 public:
  // `print_every`: steps between progress lines (--log-every); the log gets every step.
  StepLog(const std::string& path, const LogOwner& owner, int print_every = 1);
  // Hands each later line to `writer` too (--tensorboard, --wandb): MetricsBridge's arguments.
  void add_writer(const MetricsWriter& writer, const std::string& target, const std::vector<std::string>& options = {});
  // Appends the step's JSON line; prints its progress line every print_every steps, and for the
  // run's first and last steps and any skipped or evaluated one.
  void write(const StepRecord& record);
  const std::string& path() const { return file_->path(); }
  // Waits for the writers to finish their files and warns on stderr of each that failed (the run's
  // outcome stays: the log has every step). Returns where the others wrote: ", TensorBoard in DIR".
  std::string close_writers();

 private:
  std::unique_ptr<io::LockedFile> file_;
  LogOwner owner_;
  bool marked_ = false;  // this run's first line, with its run mark, is written
  std::vector<std::unique_ptr<MetricsBridge>> writers_;
  int print_every_;
  bool printed_ = false;
  std::deque<double> recent_ms_;  // the last steps' times, for the time left
  bool dropped_first_ = false;
};

}  // namespace fsdp::train
