// fsdp-train's run, as a story: the constructor sets up (communicator, data, the sharded model,
// the optimizer, a resumed checkpoint), train() runs each step as train_step() followed by its
// report, the planner's phases (PlannedRun), the checks and the saves, then finish() writes the
// run's outputs. fsdp_train.cpp parses the command line and calls it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "fsdp/fsdp.h"
#include "model/llama.h"
#include "train/args.h"
#include "train/data.h"
#include "train/fused_adamw.h"
#include "train/lr_schedule.h"
#include "train/memory_sampler.h"
#include "train/planned_run.h"
#include "train/step_log.h"

namespace fsdp::train {

// SIGTERM, SIGINT, SIGUSR1 (a job scheduler's notice) or SIGHUP make the run finish its step, save
// and stop.
void install_stop_handlers();

// fsdp-train's exit code for a run a signal stopped before --steps with its state saved: not
// finished, nothing exported; the same command with --resume continues it (a scheduler's "requeue
// me"). fsdp-run passes it on without a message.
constexpr int kStoppedResumable = 3;

class Trainer {
 public:
  explicit Trainer(const TrainArgs& args);  // set-up; collective
  ~Trainer();
  // Trains from the first step (a resumed run's next) to --steps, or until a signal, --stop-at-step,
  // a divergence or the planner stops it; exports; returns the process's exit code.
  int train();

 private:
  struct StepResult {
    at::Tensor loss, grad_norm;  // on the device: the (micro-batch summed) loss, the norm if computed
    bool skipped = false;        // --max-skipped-steps: not finite, no optimizer step taken
  };
  struct StepOutcome {  // a step as read on the host, every rank agreeing
    double loss = 0, ms = 0;
    std::optional<double> grad_norm;
    bool skipped = false, stop_requested = false, log_failed = false;
  };
  void claim_outputs();  // the save directory's lock and the log's, before any work; collective
  void shard_model();
  void resume();
  void set_aside_abandoned_branch();
  void print_banner() const;
  StepResult train_step(int step, PlannedRun::StartRecording start_recording);  // one optimizer step
  StepOutcome read_step(const StepResult& result, std::chrono::steady_clock::time_point start);
  void report(int step, const StepOutcome& outcome, double lr, bool stop);  // the line, the log, evaluation
  bool goes_on_after_nonfinite(int done, const StepOutcome& outcome);       // false: diverged
  bool state_is_finite(int done, const char* action);
  // A checkpoint of the state after `steps_done` steps; with `in_background` (--async-save) only
  // copied to host memory here, its files written while training goes on.
  void save(int steps_done, bool in_background);
  void finish_pending_save();  // publishes a background save (collective)
  void after_saved();          // --overwrite-checkpoints, --keep-last, once a save is published
  int finish();  // export, profile, snapshot, logs closed

  const TrainArgs& args_;
  std::shared_ptr<Communicator> comm_;
  bool lead_ = false;  // rank 0: prints and writes the log
  c10::Device device_;
  model::LlamaConfig config_;
  std::unique_ptr<TokenSource> data_, eval_data_;
  DataRank data_rank_;  // this rank's rows of each batch (tensor parallelism: its tp group's)
  model::Llama model_{nullptr};
  ShardOptions shard_;
  std::unique_ptr<FusedAdamW> optimizer_;
  CheckpointState checkpoint_;
  std::unique_ptr<CheckpointWrite> pending_save_;  // --async-save: written, not yet published
  std::chrono::steady_clock::time_point pending_since_;
  std::string resume_from_;  // the checkpoint --resume takes ("" for a fresh run)
  std::string run_id_;       // the lineage's: drawn by a fresh run, kept by its resumes
  std::unique_ptr<io::LockedFile> save_dir_lock_;  // rank 0, held for the run
  bool replaced_other_runs_ = false;               // --overwrite-checkpoints done
  int first_step_ = 0, steps_done_ = 0, skipped_steps_ = 0, exit_code_ = 0;
  int64_t first_sample_ = 0;  // the data's position at first_step_ (resumed: the checkpoint's)
  // Sequences a step trains on, over all ranks; the samples trained on before `step`.
  int64_t global_batch() const { return int64_t(args_.grad_accum) * args_.batch * data_rank_.count; }
  int64_t samples_before(int step) const { return first_sample_ + (step - first_step_) * global_batch(); }
  LrSchedule lr_schedule_;
  double clip_norm_ = 0;  // 0: no norm computed
  std::optional<StepLog> step_log_;
  std::string log_error_;  // rank 0: why the log could not be written ("" while it can)
  std::unique_ptr<MemorySampler> sampler_;
  std::optional<PlannedRun> planned_;  // --memory-budget / --plan-check
  int trace_step_ = 0;
  RuntimeStats stats_before_;
};

}  // namespace fsdp::train
