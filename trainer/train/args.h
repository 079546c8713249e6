// fsdp-train's command line: the flags, their defaults, and every check that can be made before
// any rank starts work. A usage error is reported once (by the first rank) and ends the run with
// exit code 2, before any process joins a communicator.
#pragma once

#include <c10/core/ScalarType.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "fsdp/runtime_options.h"
#include "model/llama.h"
#include "train/usage_error.h"

namespace fsdp::train {

struct TrainArgs {
  std::string model = "tiny";
  int steps = 20;
  int64_t batch = 4;  // per rank
  int64_t seq = 128;
  double lr = 3e-3, min_lr = 3e-4, weight_decay = 0.1, clip = 1.0;
  int warmup = 5;
  uint64_t seed = 1234;
  std::string data = "synthetic";
  std::string param_dtype = "auto", reduce_dtype = "fp32";
  bool reshard_after_forward = true, tie_embeddings = false, recompute = false;
  bool cpu_offload = false;  // ShardOptions::cpu_offload: sharded state and the optimizer step on the host
  bool keep_compute_shards = false;  // ShardOptions::keep_compute_shards, written by AdamW
  bool optimizer_in_backward = false;  // fsdp::set_step_in_backward: AdamW per group as gradients arrive
  int replicas = 1;          // HSDP (fsdp::make_mesh): replica groups, each sharding the model over its ranks
  int tp = 1;                // tensor parallelism (fsdp::make_mesh's tp): ranks splitting each layer
  std::string backend = "auto";
  std::string attention = "aten";  // attention kernel: aten, flash (model::AttentionKernel)
  std::string attention_mask = "causal";  // or block_causal: within documents (LlamaConfig::block_causal)
  int64_t eos_id = -1;  // the id ending a document; -1: --init-from's eos_token_id (LlamaConfig::eos_token_ids)
  std::string fp8 = "off";  // the blocks' projections in float8: off, tensorwise, rowwise (fsdp::Float8Recipe)
  bool fp8_all_gather = true;  // tensorwise: the projections' weights all-gathered in float8
  std::string log;  // empty: runs/<date-time>/fsdp-train.jsonl (default_log_path)
  int log_every = 1;  // steps between progress lines (the log keeps every step)
  std::string tensorboard;  // rank 0 also writes the step lines as TensorBoard scalars here
  std::string wandb;        // and as a W&B run in this project
  double timeout_s = 0;
  RuntimeOptions runtime;
  std::string save_init;  // file for the initial full weights (rank 0)
  std::string trace, memory_snapshot, memory_log, profile;
  bool optimizer_before_shard = false;
  int trace_steps = 2;
  int profile_steps = 2;
  std::string save_dir, resume;  // checkpoints: where to save, where to resume from
  int save_every = 0;            // steps between saves, 0 = only at the end or when stopped
  bool async_save = false;       // --save-every's checkpoints written while training goes on
  int keep_last = 0;             // this run's newest checkpoints kept in --save-dir; 0 = all
  int stop_at_step = 0;          // save and stop after this step, 0 = run all --steps
  int grad_accum = 1;                 // micro-batches of --batch rows per optimizer step
  std::string grad_accum_sync = "last";  // reduce-scatter after the "last" micro-batch or "every" one
  std::string eval_data;              // held-out token file; empty: no evaluation
  int eval_every = 0;                 // steps between evaluations, 0 = only after the last step
  int eval_batches = 8;               // evaluation set: this many batches of --batch rows
  std::string init_from;    // Hugging Face weights (.safetensors, or a directory with config.json)
  std::string export_path;  // write the trained model with Hugging Face names (.safetensors or a directory)
  std::string export_dtype = "auto";  // fp32, bf16, auto = the --init-from directory's dtype, else fp32
  double export_shard_gb = 5;         // a directory export's largest weight file, GB
  double memory_budget_gib = 0;  // > 0: plan the schedule within this much allocated memory per rank
  bool plan_only = false;        // with --memory-budget: profile, print the plan, stop
  std::string plan_check;        // bench: predicted vs measured for several budgets' plans, to this file
  int plan_check_budgets = 8, plan_check_steps = 6, plan_check_rounds = 2;
  std::string cost_model;  // with --memory-budget or --plan-check: write the profiled cost model here (rank 0)
  std::string project;     // print a --cost-model file's step projected to --project-worlds GPUs, train nothing
  std::string project_worlds = "8,16,32,64,128,256,512";
  std::string project_tp = "1";  // tensor-parallel degrees --project tries
  int gpus_per_host = 8;            // plan::Cluster: GPUs a host joins by NVLink
  double network_gb_per_s = 50;     // plan::Cluster: each GPU's bandwidth to other hosts
  bool dry_run = false;  // check everything, print the plan, train nothing
  bool overwrite_checkpoints = false;  // other runs' checkpoints in --save-dir may go (never this run's lineage)
  bool overwrite_export = false;       // the model at --export may be replaced
  bool overwrite_log = false;          // an existing --log holding another run's steps may be emptied
  bool allow_resume_changes = false;   // --resume with another --data or --seed than the checkpoint's
  int max_skipped_steps = 0;  // steps with a non-finite loss or gradient norm skipped before the run stops
  bool help = false;     // --help: print the flags and exit
  bool version = false;  // --version: print fsdp.cpp's version and exit
  std::string config;  // --config: a JSON file of flags, which the command line's override
  // The flags given (by --config and the command line) and their values ("" for a switch): to
  // refuse those another flag makes moot, and written beside the log (write_given_flags).
  std::map<std::string, std::string> given;
};

// Bytes a parameter of the sharded training state: the fp32 weight and AdamW's two fp32 moments,
// held all run, and the fp32 gradient, held from backward to the step unless the optimizer steps in
// backward (one group's gradients at a time). The memory check and the cost model's file use them.
constexpr int kWeightAndMomentBytes = 12;
constexpr int kGradientBytes = 4;

// Reads the flags (argv without the program name). Throws UsageError naming the flag and the fix.
TrainArgs parse_train_args(const std::vector<std::string>& argv);
// The flags `a` was given, as a JSON object --config reads back ({"steps": "100", "recompute": true}).
std::string given_flags_json(const TrainArgs& a);
// How `a`'s given flags differ from those a checkpoint recorded (given_flags_json's text):
// "--lr 0.001 (was 0.003), --recompute (new), --seq (dropped; was 64)", or "" when they agree (or
// the checkpoint recorded none). --resume, which names the checkpoint, is left out.
std::string changed_flags(const std::string& recorded_json, const TrainArgs& a);
// Writes given_flags_json beside the log `log_path` (LOG.config.json for LOG.jsonl; where that exists,
// from an earlier run on the same log, LOG.config-2.json and on: none is replaced) and returns its path;
// nothing, and "", where the log is not a regular file (/dev/stdout).
std::string write_given_flags(const TrainArgs& a, const std::string& log_path);
std::string train_help_text();
// The checks that need this machine: the data file, every output path writable, and memory for
// the model and for --batch x --seq, on the GPUs when there are any (else the host).
// Throws UsageError.
void check_train_args_on_this_machine(const TrainArgs& args);
// With --cpu-offload and --optimizer-in-backward on GPUs: the least host memory (bytes) a rank's
// gradients take while they wait for the host's optimizer step (0 otherwise), for `config` (the
// run's model_config) sharded over `shard_ranks` ranks. Part of the host-memory check.
double host_gradient_bytes(const TrainArgs& args, const model::LlamaConfig& config, int shard_ranks);
// Ranks on this host, from the launcher's variables (1 without them).
int local_ranks();
// "fp32", "bf16" or "auto" (bf16 on GPUs).
c10::ScalarType dtype_named(const std::string& name, bool on_gpu);

// The model to train: config.json of --init-from where there is one, else the --model preset
// (with --tie-embeddings, --recompute and --seed applied).
model::LlamaConfig model_config(const TrainArgs& args);
// What tensor parallelism splits over `tp` ranks and `tp` does not divide, as "4 key/value heads":
// the first such of the model's key/value heads, FFN columns and vocabulary ("" where it divides
// them all; --tp also splits each micro-batch's tokens).
std::string unsplit_by_tp(const model::LlamaConfig& config, int64_t tp);
// How messages name that model: the --init-from directory, or the preset.
std::string model_name(const TrainArgs& args);

// Whether the run checks the gradient norm before each optimizer step (and skips a non-finite one).
inline bool skips_nonfinite_steps(const TrainArgs& a) { return a.max_skipped_steps > 0; }

// Whether the run profiles a step and plans (--memory-budget or --plan-check).
inline bool plans_schedule(const TrainArgs& a) { return a.memory_budget_gib > 0 || !a.plan_check.empty(); }

// runs/<YYYYmmdd-HHMMSS>-<run id>/fsdp-train.jsonl for the current local time: two runs started
// in the same second get logs of their own.
std::string default_log_path(const std::string& run_id);

// What a checkpoint records as the run's --data: the file's canonical path ("synthetic" as it is),
// so that a resume from another working directory still names the same file.
std::string recorded_data(const std::string& data);

// The path a rank writes for a per-rank output PREFIX (trace, profile, snapshot, memory log).
std::string rank_path(const std::string& prefix, int rank, const std::string& extension);
// The outputs each rank writes to its own rank_path: flag, PREFIX ("" when not asked for), extension.
struct PerRankOutput {
  std::string flag, prefix, extension;
};
std::vector<PerRankOutput> per_rank_outputs(const TrainArgs& a);

}  // namespace fsdp::train
