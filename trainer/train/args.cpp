#include "train/args.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "fsdp/launch.h"
#include "fsdp/sharded_checkpoint.h"
#include "io/files.h"
#include "model/hf_llama.h"
#include "model/linear_cross_entropy.h"
#include "model/llama.h"
#include "train/config_file.h"
#include "train/data.h"
#include "train/lineage.h"
#include "train/memory.h"
#include "train/metrics_bridge.h"

namespace fsdp::train {
namespace {

// Bounds that keep a number's arithmetic sane: a week of waiting for one collective (a deadline in
// nanoseconds must not overflow), and a million GB per export file (its bytes must fit in int64).
constexpr double kMaxTimeoutS = 7 * 24 * 3600;
constexpr double kMaxExportShardGb = 1e6;

// What a flag does to its field, and the field's value when the table is made: for a table of
// default TrainArgs, the default --help shows (so no help string restates one).
struct Setter {
  std::function<void(const std::string&)> set;
  std::string current;  // empty: nothing to show (a switch, or a text whose default the help explains)
};

// The help's sections, in its order.
// Each flag's topic: its section of --help, and its table in a --config file ([training] steps =
// 100) and in a --table.flag=value word.
enum class Topic { Model, Training, Precision, Sharding, Planner, Checkpoints, Logs, Launch };
struct TopicName {
  const char* table;
  const char* title;
};
constexpr TopicName kTopics[] = {{"model", "model and data"},
                                 {"training", "training"},
                                 {"precision", "precision and kernels"},
                                 {"sharding", "sharding, recomputation and scheduling"},
                                 {"planner", "memory-budget planner"},
                                 {"checkpoint", "checkpoints and export"},
                                 {"logging", "configuration, logs, traces and profiles"},
                                 {"launch", "launch and checks"}};
const char* table_of(Topic topic) { return kTopics[static_cast<int>(topic)].table; }

struct Flag {
  Topic topic;
  std::string help;
  Setter value;
  bool takes_value = true;
};

// A number that reads completely and fits its type (no "-1" into an unsigned, no "1e99" into an int).
template <class T>
Setter number(T& field) {
  std::ostringstream current;
  current << field;
  return {[&field](const std::string& v) {
            std::istringstream in(v);
            T value{};
            const bool negative_unsigned = std::is_unsigned_v<T> && v.find('-') != std::string::npos;
            if (v.empty() || negative_unsigned || !(in >> value) || !in.eof())
              throw UsageError("'" + v + "' is not " + (std::is_integral_v<T> ? "an integer in range" : "a number"));
            if constexpr (std::is_floating_point_v<T>)
              if (!std::isfinite(value)) throw UsageError("'" + v + "' is not a finite number");
            field = value;
          },
          current.str()};
}

Setter text(std::string& field) {
  return {[&field](const std::string& v) { field = v; }, field};
}
Setter set_true(bool& field) {
  return {[&field](const std::string&) { field = true; }, ""};
}

// fsdp-train's flag for a RuntimeOptions knob: --prefetch-depth for prefetch_depth.
std::string runtime_flag(const char* name) {
  std::string flag = std::string("--") + name;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

std::map<std::string, Flag> flags(TrainArgs& a) {
  std::map<std::string, Flag> table = {
      {"--model", {Topic::Model, "preset: tiny, small, 1b, 3b, 8b", text(a.model)}},
      {"--steps", {Topic::Training, "training steps", number(a.steps)}},
      {"--batch", {Topic::Model, "sequences per rank per step (with --tp, per tp group: its ranks split them)", number(a.batch)}},
      {"--seq", {Topic::Model, "tokens per sequence", number(a.seq)}},
      {"--lr", {Topic::Training, "peak learning rate", number(a.lr)}},
      {"--min-lr", {Topic::Training, "final learning rate of the cosine decay", number(a.min_lr)}},
      {"--warmup", {Topic::Training, "linear warmup steps", number(a.warmup)}},
      {"--weight-decay", {Topic::Training, "AdamW weight decay", number(a.weight_decay)}},
      {"--clip", {Topic::Training, "global gradient-norm clip, 0 = off", number(a.clip)}},
      {"--seed", {Topic::Model, "seed for weights and data", number(a.seed)}},
      {"--data",
       {Topic::Model,
        "'synthetic', a token file FILE.bin (llm.c or nanoGPT layout, memory-mapped), a directory "
        "of such files (one corpus, in name order) or a text file read as bytes; each epoch reads "
        "every sequence once, in an order --seed chooses",
        text(a.data)}},
      {"--eval-data",
       {Topic::Model, "held-out data (same kinds as --data) for an evaluation loss and perplexity", text(a.eval_data)}},
      {"--eval-every", {Topic::Model, "steps between evaluations, 0 = after the last step only", number(a.eval_every)}},
      {"--eval-batches",
       {Topic::Model,
        "evaluation set size in batches of --batch sequences: the --eval-data's first ones, the "
        "same set whatever the rank count",
        number(a.eval_batches)}},
      {"--grad-accum",
       {Topic::Training, "micro-batches of --batch sequences per optimizer step", number(a.grad_accum)}},
      {"--grad-accum-sync",
       {Topic::Training,
        "with --grad-accum: reduce-scatter after the 'last' micro-batch (gradients held "
        "unsharded in fp32 meanwhile) or after 'every' one (less memory, more "
        "communication)",
        text(a.grad_accum_sync)}},
      {"--param-dtype",
       {Topic::Precision, "all-gather/compute dtype: fp32, bf16, auto = bf16 on GPU", text(a.param_dtype)}},
      {"--reduce-dtype", {Topic::Precision, "reduce-scatter dtype: fp32, bf16", text(a.reduce_dtype)}},
      {"--no-reshard-after-forward",
       {Topic::Sharding, "keep blocks unsharded from forward to backward",
        Setter{[&a](const std::string&) { a.reshard_after_forward = false; }, ""}, false}},
      {"--tie-embeddings",
       {Topic::Model, "share the embedding matrix with the output head (3b always does)", set_true(a.tie_embeddings),
        false}},
      {"--recompute",
       {Topic::Sharding, "recompute every block's activations in backward (activation checkpointing)",
        set_true(a.recompute), false}},
      {"--checkpoint",
       {Topic::Sharding, "the old name of --recompute, accepted until 0.8", set_true(a.recompute), false}},
      {"--cpu-offload",
       {Topic::Sharding,
        "keep the sharded weights, gradients and AdamW moments in host memory and step the "
        "optimizer on the CPU: the GPU holds only what forward and backward use",
        set_true(a.cpu_offload), false}},
      {"--keep-compute-shards",
       {Topic::Sharding,
        "keep each shard's copy in the param dtype (bf16) on the device, written by AdamW as it steps, so "
        "no all-gather casts the float32 shards (ShardOptions::keep_compute_shards): the shards' bytes "
        "in bf16 more; on one GPU the parameters stay gathered in bf16",
        set_true(a.keep_compute_shards), false}},
      {"--optimizer-in-backward",
       {Topic::Sharding,
        "step AdamW group by group in backward, as each group's gradients are reduced, and free them: no "
        "model-sized gradients (with --cpu-offload " + std::to_string(kWeightAndMomentBytes) +
            " bytes of host memory a parameter instead of " +
            std::to_string(kWeightAndMomentBytes + kGradientBytes) + "); needs --clip 0",
        set_true(a.optimizer_in_backward), false}},
      {"--replicas",
       {Topic::Sharding,
        "HSDP: split the ranks into this many replicas, each sharding the model over its "
        "ranks (consecutive ones); gradients are averaged across replicas (1 = plain FSDP)",
        number(a.replicas)}},
      {"--tp",
       {Topic::Sharding,
        "tensor parallelism: split each block's projections (by heads and FFN columns), the embedding and "
        "the head (by vocabulary) over this many consecutive ranks, sequence-parallel between them; FSDP shards "
        "each part over the ranks holding it (ranks = replicas x shards x tp)",
        number(a.tp)}},
      {"--backend", {Topic::Launch, "auto, mpi (CPU) or nccl (GPU)", text(a.backend)}},
      {"--attention",
       {Topic::Precision,
        "attention kernel: aten (ATen's choice: cuDNN on Hopper) or flash (FlashAttention-2 where "
        "it applies)",
        text(a.attention)}},
      {"--attention-mask",
       {Topic::Model,
        "causal (over the whole sequence) or block_causal (packed documents: each token attends "
        "only to its own document's, a document ending with --eos-id)",
        text(a.attention_mask)}},
      {"--eos-id",
       {Topic::Model, "the token id that ends a document (fsdp-prepare-data puts the tokenizer's after each); "
        "default: --init-from's eos_token_id", number(a.eos_id)}},
      {"--fp8",
       {Topic::Precision,
        "the blocks' projections (QKV, output, gate/up, down) in float8 with dynamic scales: off, "
        "tensorwise or rowwise (GPUs of compute capability 8.9+; CPU ranks emulate it)",
        text(a.fp8)}},
      {"--no-fp8-all-gather",
       {Topic::Precision,
        "with --fp8 tensorwise: all-gather the projections' weights in bf16 and cast them in each forward and "
        "backward, instead of all-gathering them in float8 (on by default, off with --cpu-offload)",
        Setter{[&a](const std::string&) { a.fp8_all_gather = false; }, ""}, false}},
      {"--config",
       {Topic::Logs,
        "a JSON object of flags and their values ({\"model\": \"1b\", \"steps\": 100, \"recompute\": "
        "true}) or a .toml file of them, each at the top or in its topic's [table] (below), taken before "
        "the command line's, which override them (--training.steps=200 names a flag by its table too); "
        "every run writes the flags it was given beside its log (LOG.config.json), which --config reads back",
        text(a.config)}},
      {"--log",
       {Topic::Logs, "JSONL log written by rank 0 (none given: runs/<date-time>/fsdp-train.jsonl)", text(a.log)}},
      {"--tensorboard",
       {Topic::Logs,
        "rank 0 also writes each step's loss, lr, grad norm, tokens/s, TFLOP/s a GPU and memory as "
        "TensorBoard scalars in DIR (python -m fsdpcpp.tensorboard, TensorBoard's own writer)",
        text(a.tensorboard)}},
      {"--wandb",
       {Topic::Logs,
        "rank 0 also logs the same scalars as a Weights & Biases run in PROJECT, named by the run's id, "
        "its config the flags given (python -m fsdpcpp.wandb, wandb itself; W&B's environment applies: "
        "WANDB_MODE=offline, WANDB_DIR, WANDB_ENTITY)",
        text(a.wandb)}},
      {"--log-every",
       {Topic::Logs,
        "steps between progress lines (also the first, the last and any skipped or evaluated "
        "step); the --log file keeps every step",
        number(a.log_every)}},
      {"--timeout",
       {Topic::Launch, "seconds a collective may wait, 0 = default (300, or FSDP_TIMEOUT_S)", number(a.timeout_s)}},
      {"--trace", {Topic::Logs, "Chrome trace of steps 2.. (see --trace-steps) to PATH-rankR.json", text(a.trace)}},
      {"--trace-steps", {Topic::Logs, "steps the trace covers, from the second", number(a.trace_steps)}},
      {"--profile",
       {Topic::Logs,
        "PyTorch profiler (kineto) trace of the last --profile-steps steps: CPU ops and "
        "GPU kernels per stream, to PATH-rankR.json",
        text(a.profile)}},
      {"--profile-steps", {Topic::Logs, "steps the profile covers, at the end of the run", number(a.profile_steps)}},
      {"--memory-snapshot",
       {Topic::Logs, "GPU: allocator history of the run to PATH-rankR.pickle (pytorch.org/memory_viz)",
        text(a.memory_snapshot)}},
      {"--memory-log",
       {Topic::Logs, "sample memory every 10 ms into PATH-rankR.jsonl, with step markers", text(a.memory_log)}},
      {"--optimizer-before-shard",
       {Topic::Training, "create AdamW before fully_shard (trains the same: the parameters are sharded in place)",
        set_true(a.optimizer_before_shard), false}},
      {"--save-init",
       {Topic::Checkpoints, "write the initial full weights here (torch.load-able; for benchmarks)",
        text(a.save_init)}},
      {"--save-dir",
       {Topic::Checkpoints,
        "save sharded checkpoints under DIR/step-N (at --save-every, at the end, at "
        "--stop-at-step, and on SIGTERM/SIGINT/SIGUSR1 at the next step boundary)",
        text(a.save_dir)}},
      {"--save-every",
       {Topic::Checkpoints, "steps between checkpoints, 0 = only at the end or when stopped", number(a.save_every)}},
      {"--async-save",
       {Topic::Checkpoints,
        "write --save-every's checkpoints in the background: each is copied to host memory (a copy of "
        "the rank's sharded state) and published at the next save; the last and a stopping one are whole "
        "before exit",
        set_true(a.async_save), false}},
      {"--keep-last",
       {Topic::Checkpoints,
        "after each save, remove this run's checkpoints in --save-dir but the newest N (those it "
        "resumed from included; other runs' never); 0 = keep all",
        number(a.keep_last)}},
      {"--resume",
       {Topic::Checkpoints, "resume from the newest complete checkpoint in DIR (any rank count)", text(a.resume)}},
      {"--stop-at-step",
       {Topic::Checkpoints, "save and exit 0 after this step; the schedule stays that of --steps; 0 = run all --steps",
        number(a.stop_at_step)}},
      {"--init-from",
       {Topic::Model,
        "start from Hugging Face Llama weights: a .safetensors file or a directory with "
        "config.json (which then gives the model) and *.safetensors; each rank reads its rows",
        text(a.init_from)}},
      {"--export",
       {Topic::Checkpoints,
        "after training, write the model with Hugging Face LlamaForCausalLM names: FILE.safetensors, "
        "or a directory for from_pretrained (config.json, weight files of at most --export-shard-gb "
        "and their model.safetensors.index.json); --steps 0 with --init-from or --resume converts",
        text(a.export_path)}},
      {"--export-dtype",
       {Topic::Checkpoints, "--export's dtype: fp32, bf16, auto = the --init-from directory's dtype, else fp32",
        text(a.export_dtype)}},
      {"--export-shard-gb",
       {Topic::Checkpoints, "--export to a directory: the largest weight file, GB (10^9 bytes)",
        number(a.export_shard_gb)}},
      {"--memory-budget",
       {Topic::Planner,
        "GiB of GPU memory (allocated, per rank) the run may use: step 3 is profiled, step 5 "
        "calibrated, and the fastest schedule predicted to fit (blocks recomputed, blocks kept "
        "unsharded, prefetch depth, in-flight caps, buckets) trains from step 6; replaces "
        "--recompute and the prefetch, in-flight and bucket flags",
        number(a.memory_budget_gib)}},
      {"--plan-only",
       {Topic::Planner, "with --memory-budget: profile, print the plan and its runners-up, stop", set_true(a.plan_only),
        false}},
      {"--plan-check",
       {Topic::Planner,
        "benchmark of the planner: after the profile and calibration, train each budget's plan "
        "a few steps and write predicted vs measured time and peak to FILE (JSONL, rank 0), then stop",
        text(a.plan_check)}},
      {"--plan-check-budgets",
       {Topic::Planner,
        "budgets --plan-check spreads from the fully recomputed peak to the "
        "unconstrained one",
        number(a.plan_check_budgets)}},
      {"--plan-check-steps",
       {Topic::Planner, "steps per schedule and round in --plan-check, two of them warm-up",
        number(a.plan_check_steps)}},
      {"--plan-check-rounds",
       {Topic::Planner,
        "rounds over the schedules in --plan-check, alternately in order and reversed, so "
        "a drift over the run reaches all alike",
        number(a.plan_check_rounds)}},
      {"--cost-model",
       {Topic::Planner,
        "with --memory-budget or --plan-check: write the profiled and calibrated cost model to FILE "
        "(JSON, rank 0), for --project",
        text(a.cost_model)}},
      {"--project",
       {Topic::Planner,
        "print the step a --cost-model FILE predicts on --project-worlds GPUs, FSDP and HSDP (one "
        "replica a host) times each --project-tp degree, under the runtime's default schedule (--recompute: "
        "every block recomputed), or with --memory-budget the planner's layout and schedule for each world; "
        "trains nothing, needs no GPU (the model: include/fsdp/plan/projection.h)",
        text(a.project)}},
      {"--project-worlds", {Topic::Planner, "GPU counts --project predicts, comma-separated", text(a.project_worlds)}},
      {"--project-tp",
       {Topic::Planner,
        "tensor-parallel degrees --project tries, comma-separated (within a host; with the --model or "
        "--init-from the cost model was measured with)",
        text(a.project_tp)}},
      {"--gpus-per-host", {Topic::Planner, "--project: GPUs a host joins by NVLink", number(a.gpus_per_host)}},
      {"--network-gb-per-s",
       {Topic::Planner, "--project: each GPU's network bandwidth to other hosts, GB/s one way",
        number(a.network_gb_per_s)}},
      {"--dry-run",
       {Topic::Launch, "check the flags, the files and the memory, print the plan, train nothing", set_true(a.dry_run),
        false}},
      {"--overwrite-checkpoints",
       {Topic::Checkpoints,
        "other runs' checkpoints in --save-dir may be replaced: they are removed once this run has saved its "
        "first (this run's own, and those it resumed from, never are); without it they make the run refuse",
        set_true(a.overwrite_checkpoints), false}},
      {"--overwrite-export",
       {Topic::Checkpoints,
        "the model already at --export may be replaced (whole, once the new one is "
        "written); without it an existing export is refused",
        set_true(a.overwrite_export), false}},
      {"--overwrite-log",
       {Topic::Logs,
        "an existing --log that holds steps of another run (or of none) is emptied first; without it such a "
        "log is refused (a resumed run of the log's own run appends to it)",
        set_true(a.overwrite_log), false}},
      {"--overwrite",
       {Topic::Checkpoints, "--overwrite-checkpoints, --overwrite-export and --overwrite-log",
        Setter{[&a](const std::string&) { a.overwrite_checkpoints = a.overwrite_export = a.overwrite_log = true; }, ""},
        false}},
      {"--allow-resume-changes",
       {Topic::Checkpoints,
        "resume even though --data or --seed differ from what the checkpoint recorded (else refused: the run "
        "would go on with other data than it trained on)",
        set_true(a.allow_resume_changes), false}},
      {"--max-skipped-steps",
       {Topic::Training,
        "steps whose loss or gradient norm is not finite are skipped (no optimizer step, "
        "one host wait a step to check) up to this many times; 0 = the first one stops "
        "the run with an error",
        number(a.max_skipped_steps)}},
  };
  for_each_runtime_option([&](const char* name, auto member, const char* meaning) {
    table[runtime_flag(name)] = {Topic::Sharding, meaning, number(a.runtime.*member)};
  });
  return table;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw UsageError(message);
}

// A system call's result: an empty string, or why it failed (errno read right after the call,
// before any message is built).
std::string failure(int result) { return result == 0 ? "" : std::strerror(errno); }

// A flag whose value only matters with another flag is refused without it: a run never ignores
// what it was told.
void check_flags_that_need_another(const TrainArgs& a) {
  const auto given = [&a](const char* flag) { return a.given.count(flag) > 0; };
  struct Needs {
    const char* flag;
    bool needed_is_there;
    const char* what;  // "--x needs WHAT"
  };
  const Needs rules[] = {
      {"--trace-steps", !a.trace.empty(), "--trace (the trace it sizes)"},
      {"--profile-steps", !a.profile.empty(), "--profile (the profile it sizes)"},
      {"--eos-id", a.attention_mask == "block_causal", "--attention-mask block_causal (the documents it separates)"},
      {"--eval-every", !a.eval_data.empty(), "--eval-data (the set it evaluates on)"},
      {"--eval-batches", !a.eval_data.empty(), "--eval-data (the set it evaluates on)"},
      {"--save-every", !a.save_dir.empty(), "--save-dir (where to save)"},
      {"--grad-accum-sync", a.grad_accum > 1, "--grad-accum 2 or more (micro-batches to sync)"},
      {"--plan-check-budgets", !a.plan_check.empty(), "--plan-check"},
      {"--plan-check-steps", !a.plan_check.empty(), "--plan-check"},
      {"--plan-check-rounds", !a.plan_check.empty(), "--plan-check"},
      {"--cost-model", plans_schedule(a), "--memory-budget or --plan-check (the profile it writes)"},
      {"--project-worlds", !a.project.empty(), "--project"},
      {"--project-tp", !a.project.empty(), "--project"},
      {"--gpus-per-host", !a.project.empty(), "--project"},
      {"--network-gb-per-s", !a.project.empty(), "--project"},
      {"--reduce-bucket-max-wait", a.runtime.bucket_mb > 0, "--bucket-mb (the buckets it caps)"},
      {"--max-pending-host-steps", a.cpu_offload && a.optimizer_in_backward,
       "--cpu-offload and --optimizer-in-backward (the host steps it caps)"},
      {"--overwrite", !a.save_dir.empty() || !a.export_path.empty() || !a.log.empty(),
       "--save-dir, --export or --log (what it replaces)"},
      {"--overwrite-log", !a.log.empty(), "--log (the log it replaces; the default log is a new file)"},
      {"--overwrite-checkpoints", !a.save_dir.empty(), "--save-dir (whose checkpoints it replaces)"},
      {"--overwrite-export", !a.export_path.empty(), "--export (the model it replaces)"},
      {"--export-dtype", !a.export_path.empty(), "--export (the model it writes)"},
      {"--export-shard-gb", !a.export_path.empty(), "--export (the model it writes)"},
      {"--allow-resume-changes", !a.resume.empty(), "--resume (the checkpoint whose settings may change)"},
  };
  for (const auto& rule : rules)
    require(!given(rule.flag) || rule.needed_is_there,
            std::string(rule.flag) + " needs " + rule.what + ": without it the flag would be ignored");
}

// The flags' values on their own, before anything is read from the machine.
void check_ranges(const TrainArgs& a) {
  try {
    model::LlamaConfig::preset(a.model);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--model: ") + e.what());
  }
  require(a.steps >= 1 || (a.steps == 0 && !a.export_path.empty() && (!a.init_from.empty() || !a.resume.empty())),
          "--steps must be at least 1 (0 only to convert: --steps 0 --init-from or --resume, and --export)");
  require(a.export_dtype == "auto" || a.export_dtype == "fp32" || a.export_dtype == "bf16",
          "--export-dtype must be fp32, bf16 or auto, not '" + a.export_dtype + "'");
  require(a.export_shard_gb > 0 && a.export_shard_gb <= kMaxExportShardGb,
          "--export-shard-gb must be positive and at most " + std::to_string(int(kMaxExportShardGb)) +
              " (a million GB: one file for any model)");
  require(a.batch >= 1, "--batch must be at least 1");
  require(a.seq >= 1 && a.seq <= (1 << 20), "--seq must be between 1 and 1048576");
  require(a.lr > 0, "--lr must be positive");
  require(a.min_lr >= 0 && a.min_lr <= a.lr, "--min-lr must be between 0 and --lr");
  require(a.warmup >= 0, "--warmup must be 0 or more");
  require(a.weight_decay >= 0, "--weight-decay must be 0 or more");
  require(a.clip >= 0, "--clip must be 0 (off) or positive");
  // Below a millisecond the timeout would be 0 ms: every collective would fail at once.
  require(a.timeout_s == 0 || (a.timeout_s >= 0.001 && a.timeout_s <= kMaxTimeoutS),
          "--timeout must be 0 (default) or from 0.001 seconds (1 ms) to " + std::to_string(int(kMaxTimeoutS)) +
              " (a week)");
  for_each_runtime_option([&](const char* name, auto member, const char* meaning) {
    require(a.runtime.*member >= 0, runtime_flag(name) + " must be 0 or more (" + meaning + ")");
  });
  require(a.save_every >= 0, "--save-every must be 0 (off) or positive");
  require(a.keep_last >= 0, "--keep-last must be 0 (keep all) or positive");
  require(!a.async_save || (!a.save_dir.empty() && a.save_every > 0),
          "--async-save needs --save-dir and --save-every (the checkpoints it writes in the background)");
  require(a.keep_last == 0 || !a.save_dir.empty(), "--keep-last needs --save-dir (whose checkpoints it keeps)");
  require(a.stop_at_step >= 0 && a.stop_at_step <= a.steps, "--stop-at-step must be between 1 and --steps");
  require(a.stop_at_step == 0 || !a.save_dir.empty(), "--stop-at-step needs --save-dir (where to save)");
  require(a.trace_steps >= 1, "--trace-steps must be at least 1");
  require(a.log_every >= 1, "--log-every must be at least 1");
  require(a.profile.empty() || (a.profile_steps >= 1 && a.profile_steps <= a.steps),
          "--profile-steps must be between 1 and --steps");
  require(a.backend == "auto" || a.backend == "mpi" || a.backend == "nccl",
          "--backend must be auto, mpi or nccl, not '" + a.backend + "'");
  for (const auto* dtype : {&a.param_dtype, &a.reduce_dtype}) dtype_named(*dtype, true);
  try {
    model::attention_kernel_named(a.attention);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--attention: ") + e.what());
  }
  require(a.attention_mask == "causal" || a.attention_mask == "block_causal",
          "--attention-mask must be causal or block_causal, not '" + a.attention_mask + "'");
  require(a.eos_id >= -1, "--eos-id must be a token id (0 or more)");
  try {
    float8_recipe_named(a.fp8);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--fp8: ") + e.what());
  }
  require(a.grad_accum >= 1, "--grad-accum must be at least 1");
  require(!a.keep_compute_shards || !a.cpu_offload,
          "--keep-compute-shards keeps bf16 copies of the shards on the GPU, and --cpu-offload keeps the shards "
          "on the host: choose one");
  require(a.replicas >= 1, "--replicas must be at least 1");
  require(a.tp >= 1, "--tp must be at least 1");
  require(a.grad_accum_sync == "last" || a.grad_accum_sync == "every",
          "--grad-accum-sync must be last or every, not '" + a.grad_accum_sync + "'");
  require(a.eval_every >= 0, "--eval-every must be 0 (after the last step) or positive");
  require(a.eval_batches >= 1, "--eval-batches must be at least 1");
  require(a.eval_data != "synthetic", "--eval-data needs a file (synthetic data has no held-out set)");
  require(a.memory_budget_gib >= 0, "--memory-budget must be a positive number of GiB");
  require(!a.plan_only || a.memory_budget_gib > 0, "--plan-only needs --memory-budget (the budget to plan for)");
  require(a.plan_check_budgets >= 1, "--plan-check-budgets must be at least 1");
  require(a.plan_check_steps >= 3, "--plan-check-steps must be at least 3 (two are warm-up)");
  require(a.plan_check_rounds >= 1, "--plan-check-rounds must be at least 1");
  require(a.gpus_per_host >= 1, "--gpus-per-host must be at least 1");
  require(a.network_gb_per_s > 0, "--network-gb-per-s must be positive");
  require(!a.optimizer_in_backward || a.clip == 0,
          "--optimizer-in-backward steps each group before the global gradient norm exists: add --clip 0");
  require(a.max_skipped_steps >= 0, "--max-skipped-steps must be 0 (stop at the first) or more");
  require(!a.optimizer_in_backward || !skips_nonfinite_steps(a),
          "--max-skipped-steps cannot skip a step that --optimizer-in-backward takes inside backward, before "
          "the loss and the gradient norm exist: drop one of them");
  check_flags_that_need_another(a);
  require(!a.optimizer_in_backward || a.grad_accum == 1 || a.grad_accum_sync == "last",
          "--optimizer-in-backward with --grad-accum steps after the last micro-batch only: "
          "use --grad-accum-sync last");
  if (plans_schedule(a)) {
    const std::string flag = a.memory_budget_gib > 0 ? "--memory-budget" : "--plan-check";
    require(!a.recompute && a.reshard_after_forward,
            flag + " chooses which blocks are recomputed and kept unsharded: drop --recompute and "
                   "--no-reshard-after-forward");
    require(a.runtime.bucket_mb == 0 && a.runtime.reduce_bucket_max_wait == 0,
            flag + " chooses the buckets (the profile sees each group's collectives apart): drop --bucket-mb and "
                   "--reduce-bucket-max-wait");
    require(!a.optimizer_in_backward,
            flag + " plans a step whose optimizer runs after backward: drop --optimizer-in-backward");
    require(!a.keep_compute_shards,
            flag + " plans memory without kept compute shards (its cost model does not count them): drop "
                   "--keep-compute-shards");
    require(a.replicas == 1,
            flag + " plans plain FSDP (its cost model has no all-reduce across replicas): drop --replicas");
    require(a.steps >= 5 + (a.plan_only || !a.plan_check.empty() ? 0 : 1),
            flag + ": step 1 records the order, step 3 is profiled, step 5 calibrated" +
                (a.plan_only || !a.plan_check.empty() ? ": --steps must be at least 5"
                                                      : ", the plan trains from step 6: --steps must be at least 6"));
  }
}

// `path` can be made: its directory exists and takes new names.
void require_creatable(const std::string& flag, const std::string& path) {
  const std::string dir = io::parent_of(path);
  require(io::is_directory(dir), flag + ": cannot write '" + path + "': the directory '" + dir + "' does not exist");
  const std::string denied = failure(access(dir.c_str(), W_OK));
  require(denied.empty(), flag + ": cannot write '" + path + "': directory '" + dir + "': " + denied);
}

// An output path must be writable: an existing regular file we may write, or a new name in an
// existing directory we may write. Checked up front so no run ends with its output lost.
void require_writable(const std::string& flag, const std::string& path) {
  struct stat st{};
  if (stat(path.c_str(), &st) == 0) {
    // Devices and pipes too (/dev/stdout is a fine log).
    require(S_ISREG(st.st_mode) || S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode),
            flag + ": '" + path + "' exists and is not a file");
    const std::string denied = failure(access(path.c_str(), W_OK));
    require(denied.empty(), flag + ": cannot write '" + path + "': " + denied);
    return;
  }
  require_creatable(flag, path);
}

// A directory to write in: an existing writable one, or a new name in a writable directory.
void require_writable_directory(const std::string& flag, const std::string& dir) {
  if (!io::exists(dir)) return require_writable(flag, dir);
  require(io::is_directory(dir), flag + ": '" + dir + "' is not a directory");
  const std::string denied = failure(access(dir.c_str(), W_OK));
  require(denied.empty(), flag + ": cannot write '" + dir + "': " + denied);
}

// One data file: readable, in a layout we know, and no token id beyond the model's vocabulary (one
// pass over the mapped file, before any rank starts). Returns its layout.
TokenFileLayout check_data_file(const std::string& flag, const std::string& path, const TrainArgs& a, int64_t vocab) {
  struct stat st{};
  const std::string missing = failure(stat(path.c_str(), &st));
  require(missing.empty(), flag + ": cannot read '" + path + "': " + missing);
  require(S_ISREG(st.st_mode), flag + ": '" + path + "' is not a regular file");
  const std::string denied = failure(access(path.c_str(), R_OK));
  require(denied.empty(), flag + ": cannot read '" + path + "': " + denied);
  const io::MappedFile file(path);
  TokenFileLayout layout;
  try {
    layout = token_file_layout(path, file.data(), file.size());
  } catch (const std::invalid_argument& e) {
    throw UsageError(flag + ": " + e.what());
  }
  // An imported model's ids are its tokenizer's: byte values would train it on nonsense.
  require(layout.format != "bytes" || a.init_from.empty(),
          flag + ": '" + path + "' is text, read one byte a token, but --init-from '" + a.init_from +
              "' brings a model whose token ids are its tokenizer's: tokenise the text first, e.g. "
              "fsdp-prepare-data --tokenizer " + (io::is_directory(a.init_from) ? a.init_from : std::string("DIR")) +
              " " + path + " --out DATA.bin, and pass that .bin file");
  const uint64_t largest = layout.tokens ? largest_token(file.data(), layout) : 0;
  require(largest < static_cast<uint64_t>(vocab),
          flag + ": '" + path + "' holds token id " + std::to_string(largest) + " (" + layout.format +
              ") but the " + model_name(a) + " model's vocabulary has " + std::to_string(vocab) +
              " ids: tokenise for this model or pick a model with a larger vocabulary");
  return layout;
}

// --data and --eval-data: a file or a directory of .bin files, each checked, holding at least
// `needed` sequences of --seq + 1 tokens.
void check_data(const std::string& flag, const std::string& path, const TrainArgs& a, int64_t vocab, int64_t needed,
                const std::string& fix) {
  std::vector<std::string> files;
  try {
    files = data_files(path);
  } catch (const std::invalid_argument& e) {
    throw UsageError(flag + ": " + e.what());
  }
  int64_t sequences = 0;
  for (const auto& file : files) sequences += windows_of(check_data_file(flag, file, a, vocab).tokens, a.seq);
  require(sequences >= needed, flag + ": '" + path + "' holds " + std::to_string(sequences) + " sequence(s) of --seq " +
                                   std::to_string(a.seq) + " + 1 tokens and the run needs " + std::to_string(needed) +
                                   ": " + fix);
}

// --export: a new name, or with --overwrite an existing model to replace whole (export_hf writes
// beside it and renames into place): an existing directory's old files are never left mixed with
// the new ones.
void check_export_path(const TrainArgs& a) {
  const bool single_file = model::exports_single_file(a.export_path);
  require(!single_file || !io::is_directory(a.export_path),
          "--export: '" + a.export_path + "' is a directory, not a .safetensors file");
  require(single_file || !io::exists(a.export_path) || io::is_directory(a.export_path),
          "--export: '" + a.export_path + "' exists and is not a directory");
  const bool empty_directory = io::is_directory(a.export_path) && io::list_directory(a.export_path).empty();
  require(!io::exists(a.export_path) || empty_directory || a.overwrite_export,
          "--export: '" + a.export_path + "' already " + (single_file ? "exists" : "holds files") +
              ": pass --overwrite-export to replace it, or export elsewhere");
  // Staged as PATH.tmp-<run id> beside it, then renamed into place: its parent must take new names.
  require_creatable("--export", a.export_path);
}

// One rule for every path the run writes: a file written is no other path of the run and never
// lies inside a model or checkpoint the run reads; a directory written into (--save-dir, which
// --resume may read from) is no file of the run; nothing lies inside what is replaced whole (a
// directory --export). Checked before anything is opened: a run refused here has touched no file.
void check_outputs_apart(const TrainArgs& a) {
  enum class Use { ReadFile, ReadTree, WriteFile, WriteInTree, ReplaceTree };
  struct RunPath {
    std::string flag, path;
    Use use;
  };
  std::vector<RunPath> paths = {
      {"--data", a.data == "synthetic" ? "" : a.data, Use::ReadFile},
      {"--eval-data", a.eval_data, Use::ReadFile},
      {"--config", a.config, Use::ReadFile},
      {"--init-from", a.init_from, Use::ReadTree},
      {"--resume", a.resume, Use::ReadTree},
      {"--log", a.log, Use::WriteFile},
      {"--log's directory", a.log.empty() ? "runs" : "", Use::WriteInTree},  // the default log's
      {"--save-init", a.save_init, Use::WriteFile},
      {"--save-dir", a.save_dir, Use::WriteInTree},
      {"--tensorboard", a.tensorboard, Use::WriteInTree},
      {"--export", a.export_path,
       a.export_path.empty() || model::exports_single_file(a.export_path) ? Use::WriteFile : Use::ReplaceTree},
  };
  for (const auto& [flag, prefix, extension] : per_rank_outputs(a))
    if (!prefix.empty()) paths.push_back({flag, rank_path(prefix, 0, extension), Use::WriteFile});
  const auto writes = [](Use use) { return use == Use::WriteFile || use == Use::WriteInTree || use == Use::ReplaceTree; };
  for (const auto& out : paths) {
    if (out.path.empty() || !writes(out.use)) continue;
    for (const auto& other : paths) {
      if (other.path.empty() || &other == &out) continue;
      const bool is_file = other.use == Use::ReadFile || other.use == Use::WriteFile;
      const bool same = (out.use != Use::WriteInTree || is_file) &&
                        io::canonical_path(out.path) == io::canonical_path(other.path);
      const bool inside_read = out.use == Use::WriteFile && other.use == Use::ReadTree &&
                               io::is_within(out.path, other.path);
      const bool replaced = out.use == Use::ReplaceTree && io::is_within(other.path, out.path);
      require(!same && !inside_read && !replaced,
              out.flag + " '" + out.path + "' would " + (replaced ? "replace" : writes(other.use) ? "write over" : "destroy") +
                  " " + other.flag + " '" + other.path + "'" + (inside_read && !same ? " (it lies inside it)" : "") +
                  ": give each output a path of its own, apart from what the run reads");
    }
  }
}

// --resume: a directory of checkpoints (the newest complete one is taken) or one checkpoint. The
// checkpoint's step must leave something to do: more steps, or an --export of what it holds.
// Returns the checkpoint's own entries (empty without --resume).
std::map<std::string, std::string> check_resume(const TrainArgs& a) {
  if (a.resume.empty()) return {};
  const std::string from = fsdp::newest_checkpoint(a.resume);
  require(!from.empty(),
          "--resume: '" + a.resume + "' holds no complete checkpoint (a step-N directory with metadata.bin)");
  std::map<std::string, std::string> extra;
  try {
    extra = fsdp::checkpoint_extra(from);
  } catch (const std::exception& e) {
    throw UsageError(std::string("--resume: ") + e.what());
  }
  const auto step = extra.find("step");
  require(step != extra.end(), "--resume: '" + from + "' records no step: not a checkpoint fsdp-train wrote");
  const int done = std::atoi(step->second.c_str());
  require(done < a.steps || !a.export_path.empty(),
          "--resume: '" + from + "' is at step " + step->second + " and --steps is " + std::to_string(a.steps) +
              ": nothing to train; raise --steps, or add --export to export it as it is");
  require(a.stop_at_step == 0 || a.stop_at_step > done,
          "--stop-at-step " + std::to_string(a.stop_at_step) + " is not after the checkpoint's step " + step->second +
              " ('" + from + "'): give a later step, or drop --stop-at-step");
  // What the run trained on: going on with other data or another seed (which orders the samples)
  // is another run, unless the user says so.
  const auto recorded = [&](const char* key) {
    const auto it = extra.find(key);
    return it == extra.end() ? std::string() : it->second;
  };
  // Its model: a checkpoint holds weights, not shapes, which the preset or --init-from's config gives.
  const std::string model = recorded("model");
  require(model.empty() || model == model_name(a) ||
              io::canonical_path(model) == io::canonical_path(model_name(a)),  // a folder named otherwise
          "--resume: '" + from + "' holds the " + model + " model, this run makes the " + model_name(a) + " model" +
              ": pass " + (model::has_hf_config(model) ? "--init-from " : "--model ") + model + " as its run did");
  const std::string data = recorded("data"), seed = recorded("seed");
  if (!a.allow_resume_changes) {
    require(data.empty() || data == a.data || data == recorded_data(a.data),
            "--resume: '" + from + "' was trained on --data " + data + ", this run has --data " + a.data +
                ": pass the same --data, or --allow-resume-changes to go on with the new data");
    require(seed.empty() || seed == std::to_string(a.seed),
            "--resume: '" + from + "' was trained with --seed " + seed + ", this run has --seed " +
                std::to_string(a.seed) + ": pass --seed " + seed + ", or --allow-resume-changes to read the samples in another order");
  }
  return extra;
}

// --save-dir: a run saves where no other run's checkpoints are, unless it is told to replace them
// (--overwrite-checkpoints): a later --resume there would take the other run's newest step. A
// resumed run's own lineage (the run id its checkpoint records) is its to continue.
void check_save_dir(const TrainArgs& a, const std::map<std::string, std::string>& resumed) {
  require_writable_directory("--save-dir", a.save_dir);
  if (a.overwrite_checkpoints) return;
  const auto others = other_runs(saved_checkpoints(a.save_dir), run_of(resumed));
  if (others.empty()) return;
  const auto& newest = others.back();
  throw UsageError("--save-dir: '" + a.save_dir + "' holds checkpoints of another run (newest '" + newest.path + "'" +
                   (newest.run.empty() ? "" : ", run " + newest.run) + "): --resume " + newest.path +
                   " continues that run, --overwrite-checkpoints replaces its checkpoints; or save elsewhere");
}

// The launcher's variables (fsdp::parse_launch_env), a malformed set being the user's to fix.
LaunchEnv launch_env() {
  try {
    return launch_env_from_process();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

std::string gib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof(s), "%.1f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return s;
}

}  // namespace

// Gradients reach the host a group at a time and up to --max-pending-host-steps groups' wait
// there for the step thread: at least the largest group's (the root's embeddings and head) or
// that many blocks', in the reduce dtype.
double host_gradient_bytes(const TrainArgs& a, const model::LlamaConfig& config, int shard_ranks) {
  if (!a.cpu_offload || !a.optimizer_in_backward) return 0.0;
  const double block = static_cast<double>(config.block_parameter_count());
  const double root = static_cast<double>(config.parameter_count()) - config.n_layers * block;
  const double waiting_blocks = std::min<int64_t>(std::max(a.runtime.max_pending_host_steps, 1), config.n_layers);
  return std::max(root, waiting_blocks * block) * c10::elementSize(dtype_named(a.reduce_dtype, true)) / shard_ranks;
}

std::string unsplit_by_tp(const model::LlamaConfig& config, int64_t tp) {
  for (const auto& [size, what] : {std::pair<int64_t, const char*>{config.n_kv_heads, "key/value heads"},
                                   {config.ffn, "FFN columns"}, {config.vocab, "vocabulary ids"}})
    if (size % tp != 0) return std::to_string(size) + " " + what;
  return "";
}

namespace {

// Lower bounds, not estimates: a run below them cannot fit, a run above them still may not.
// `config` is the run's model (model_config), `gpu` the smallest GPU's bytes (-1: none, or CPU ranks).
void check_memory(const TrainArgs& a, const model::LlamaConfig& config, double gpu) {
  const double params = static_cast<double>(config.parameter_count());
  const int local = local_ranks();
  const double host = available_host_bytes();
  const bool on_gpu = gpu > 0;
  const double compute_bytes = c10::elementSize(dtype_named(a.param_dtype, on_gpu));
  const int world = launch_env().world_size;
  if (world % a.replicas != 0)
    throw UsageError("--replicas " + std::to_string(a.replicas) + " does not divide the " + std::to_string(world) +
                     " ranks: each replica needs as many ranks as the others");
  if (world % (a.replicas * a.tp) != 0)
    throw UsageError("--tp " + std::to_string(a.tp) + " does not divide the " + std::to_string(world / a.replicas) +
                     " ranks of a replica: ranks = replicas x shards x tp");
  const int64_t tp = a.tp, micro_batch_tokens = int64_t(a.batch) * a.seq;
  std::string unsplit = unsplit_by_tp(config, tp);
  if (unsplit.empty() && micro_batch_tokens % tp != 0)
    unsplit = std::to_string(micro_batch_tokens) + " tokens of a micro-batch (--batch x --seq)";
  if (!unsplit.empty())
    throw UsageError("--tp " + std::to_string(tp) + ": the " + model_name(a) + " model's " + unsplit +
                     " do not split over " + std::to_string(tp) + " ranks: choose a --tp that divides them");
  const int shard_ranks = world / a.replicas;  // HSDP: the state is sharded over one replica's ranks
  const double tokens = static_cast<double>(a.batch) * a.seq;
  // Sharded fp32 weights, gradients and AdamW's two moments; one chunk of the loss's float32
  // logits (model::linear_cross_entropy's default cap); per block at least its input
  // (recomputed) or its input, q, k, v, attention output and the MLP's three ffn-wide products.
  // --grad-accum-sync last holds every group's full gradients in the reduce dtype between micro-batches.
  const double held_gradients = a.grad_accum > 1 && a.grad_accum_sync == "last"
                                    ? params * c10::elementSize(dtype_named(a.reduce_dtype, on_gpu))
                                    : 0.0;
  const double state_bytes = kWeightAndMomentBytes + (a.optimizer_in_backward ? 0 : kGradientBytes);
  const double sharded_state = state_bytes * params / shard_ranks;
  // --cpu-offload: that state is in host memory (every local rank's), none of it on the GPU.
  const bool offloaded = a.cpu_offload && on_gpu;
  const double host_gradients = offloaded ? host_gradient_bytes(a, config, shard_ranks) : 0.0;
  const double host_state = (sharded_state + host_gradients) * local;
  const double state = (offloaded ? 0.0 : sharded_state) + held_gradients;
  const double loss_chunk = std::min(tokens * config.vocab * 4.0, double(model::kLossChunkBytes));
  // A budget's plan may recompute every block: its bound is the recomputed one.
  const bool recomputed = a.recompute || plans_schedule(a);
  const double per_block = recomputed ? config.dim : 4.0 * config.dim + 3.0 * config.ffn;
  const double activations = tokens * config.n_layers * per_block * compute_bytes / a.tp;  // split by --tp
  const double needed = state + loss_chunk + activations;
  const double have = on_gpu ? gpu : host / local;
  const std::string where = on_gpu ? " of a GPU" : " of host memory per process";
  // Parameters are made as shards (sharded initialisation): the model itself needs only its
  // share of the state on each rank.
  if (offloaded && host > 0 && host_state > host)
    throw UsageError("--cpu-offload: the " + model_name(a) + " model's sharded state (" +
                     std::to_string(int(state_bytes)) + " bytes a parameter" +
                     (host_gradients > 0 ? ") and the gradients waiting for its step take " : ") takes ") +
                     gib(host_state) + " of host memory for this host's " + std::to_string(local) +
                     " rank(s), more than the " + gib(host) + " available: use more hosts" +
                     (a.optimizer_in_backward ? "" : ", --optimizer-in-backward (" + std::to_string(kWeightAndMomentBytes) + " bytes a parameter)") +
                     (a.runtime.max_pending_host_steps > 1 ? ", a lower --max-pending-host-steps" : "") +
                     " or a smaller model");
  if (have > 0 && !offloaded && sharded_state > have)
    throw UsageError("the " + model_name(a) + " model's sharded state (weights, gradients and AdamW moments, " +
                     std::to_string(int(state_bytes)) + " bytes a parameter) takes " + gib(sharded_state) +
                     " per rank on " + std::to_string(shard_ranks) + " rank(s)" + (a.replicas > 1 ? " a replica" : "") +
                     ", more than the " + gib(have) + where +
                     ": use more ranks, " + (a.replicas > 1 ? "fewer --replicas, " : "") +
                     (on_gpu && !a.cpu_offload ? "--cpu-offload, " : "") + "or a smaller model");
  if (on_gpu && a.memory_budget_gib * 1024.0 * 1024.0 * 1024.0 > gpu)
    throw UsageError("--memory-budget " + gib(a.memory_budget_gib * 1024.0 * 1024.0 * 1024.0) +
                     " is more than the GPU's " + gib(gpu) + ": give at most that");
  if (have > 0 && needed > have)
    throw UsageError("--batch " + std::to_string(a.batch) + " x --seq " + std::to_string(a.seq) + " on the " +
                     model_name(a) + " model needs at least " + gib(needed) + " per rank (" + gib(state) +
                     (held_gradients > 0 ? " sharded state and held gradients, " : " sharded state, ") +
                     gib(loss_chunk + activations) + " activations), more than the " + gib(have) + where +
                     ": lower --batch or --seq" + (recomputed ? "" : ", or add --recompute") +
                     (held_gradients > 0 ? ", or use --grad-accum-sync every" : ""));
}

// The flags of --config FILE as command-line words: "--name=value", a switch given true alone (one
// given false is left out), in the file's order. A key in a table must be a flag of that topic.
std::vector<std::string> config_words(const std::string& path, const std::map<std::string, Flag>& table) {
  std::vector<std::string> words;
  std::set<std::string> seen;
  const std::string where = "--config '" + path + "': ";
  for (const ConfigEntry& e : read_config_file(path)) {
    const std::string flag = "--" + e.key;
    const std::string shown = e.table.empty() ? "'" + e.key + "'" : "'" + e.table + "." + e.key + "'";
    const auto it = table.find(flag);
    if (e.key == "config") throw UsageError(where + "a --config cannot name another");
    if (it == table.end()) throw UsageError(where + "unknown flag " + shown + " (see --help)");
    if (!e.table.empty() && e.table != table_of(it->second.topic))
      throw UsageError(where + shown + ": --" + e.key + " belongs in [" + table_of(it->second.topic) + "]");
    if (!seen.insert(e.key).second)
      throw given_twice(path, e.key);
    if (!it->second.takes_value) {
      if (e.kind != ConfigEntry::Kind::Boolean) throw UsageError(where + shown + " is a switch: give true or false");
      if (e.value == "true") words.push_back(flag);
    } else if (e.kind == ConfigEntry::Kind::Text || e.kind == ConfigEntry::Kind::Number) {
      words.push_back(flag + "=" + e.value);
    } else {
      throw UsageError(where + shown + " needs a string or a number");
    }
  }
  return words;
}

// "--training.steps" as the flag it names, "--steps" (the table checked against the flag's
// topic); any other word as it is.
std::string untabled(const std::string& word, const std::map<std::string, Flag>& table) {
  const size_t equals = word.find('=');
  const size_t dot = word.find('.');
  if (word.rfind("--", 0) != 0 || dot == std::string::npos || dot > equals) return word;
  const std::string section = word.substr(2, dot - 2), flag = "--" + word.substr(dot + 1);
  const auto it = table.find(flag.substr(0, flag.find('=')));
  if (it == table.end()) return word;  // reported as an unknown flag
  if (section != table_of(it->second.topic))
    throw UsageError(word.substr(0, equals) + ": " + it->first + " belongs in [" + table_of(it->second.topic) +
                     "] (--" + table_of(it->second.topic) + "." + it->first.substr(2) + ")");
  return flag;
}

}  // namespace

int local_ranks() { return launch_env().local_world_size; }

c10::ScalarType dtype_named(const std::string& name, bool on_gpu) {
  if (name == "fp32") return c10::kFloat;
  if (name == "bf16") return c10::kBFloat16;
  if (name == "auto") return on_gpu ? c10::kBFloat16 : c10::kFloat;
  throw UsageError("dtype must be fp32, bf16 or auto, not '" + name + "'");
}

TrainArgs parse_train_args(const std::vector<std::string>& argv) {
  TrainArgs a;
  auto table = flags(a);
  std::vector<std::string> command_line;  // --training.steps=100 as --steps=100
  for (const std::string& word : argv) command_line.push_back(untabled(word, table));
  // --config's flags come first, as --name=value words (a switch alone), then the command line's.
  std::vector<std::string> words;
  for (size_t i = 0; i < command_line.size(); ++i) {
    const bool spaced = command_line[i] == "--config" && i + 1 < command_line.size();
    if (spaced || command_line[i].rfind("--config=", 0) == 0) {
      a.config = spaced ? command_line[i + 1] : command_line[i].substr(9);
      words = config_words(a.config, table);
      break;
    }
  }
  const size_t from_command_line = words.size();
  words.insert(words.end(), command_line.begin(), command_line.end());
  std::set<std::string> from_config;
  for (size_t i = 0; i < words.size(); ++i) {
    if (words[i] == "--help" || words[i] == "-h" || words[i] == "--version") {
      (words[i] == "--version" ? a.version : a.help) = true;
      return a;
    }
    // --name value, or --name=value.
    const size_t equals = words[i].find('=');
    const std::string name = words[i].substr(0, equals);
    auto it = table.find(name);
    if (it == table.end()) throw UsageError("unknown flag '" + name + "' (see --help)");
    // One value a flag: which of two the user meant is not ours to guess. The command line's
    // overrides --config's.
    if (a.given.count(name) && !(i >= from_command_line && from_config.erase(name)))
      throw UsageError(name + " is given twice: give it once");
    std::string value;
    if (equals != std::string::npos) {
      if (!it->second.takes_value) throw UsageError(name + " takes no value: give it alone");
      value = words[i].substr(equals + 1);
    } else if (it->second.takes_value) {
      if (i + 1 >= words.size()) throw UsageError(name + " needs a value");
      value = words[++i];
    }
    try {
      it->second.value.set(value);
    } catch (const std::exception& e) {
      throw UsageError(name + (i < from_command_line ? " (from --config '" + a.config + "')" : "") + ": " + e.what());
    }
    a.given[name] = value;
    if (i < from_command_line) from_config.insert(name);
  }
  check_ranges(a);
  return a;
}

namespace {

// The flags `a` was given as JSON: each name without its dashes, a switch true (--config left out).
nlohmann::ordered_json given_flags(const TrainArgs& a) {
  nlohmann::ordered_json flags = nlohmann::ordered_json::object();
  for (const auto& [name, value] : a.given)
    if (name != "--config")
      flags[name.substr(2)] = value.empty() ? nlohmann::ordered_json(true) : nlohmann::ordered_json(value);
  return flags;
}

}  // namespace

std::string given_flags_json(const TrainArgs& a) { return given_flags(a).dump(2) + "\n"; }

std::string changed_flags(const std::string& recorded_json, const TrainArgs& a) {
  const auto recorded = nlohmann::ordered_json::parse(recorded_json, nullptr, /*allow_exceptions=*/false);
  if (!recorded.is_object()) return "";
  const auto now = given_flags(a);
  const auto shown = [](const nlohmann::ordered_json& v) { return v.is_string() ? v.get<std::string>() : ""; };
  std::string changes;
  const auto add = [&changes](const std::string& change) { changes += (changes.empty() ? "" : ", ") + change; };
  for (const auto& [key, value] : now.items()) {
    if (key == "resume") continue;
    const std::string flag = "--" + key + (shown(value).empty() ? "" : " " + shown(value));
    if (!recorded.contains(key))
      add(flag + " (new)");
    else if (recorded[key] != value)
      add(flag + " (was " + shown(recorded[key]) + ")");
  }
  for (const auto& [key, value] : recorded.items())
    if (key != "resume" && !now.contains(key))
      add("--" + key + " (dropped" + (shown(value).empty() ? "" : "; was " + shown(value)) + ")");
  return changes;
}

std::string write_given_flags(const TrainArgs& a, const std::string& log_path) {
  struct stat st{};
  if (stat(log_path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";  // a log on a device or pipe
  const bool jsonl = log_path.size() > 6 && log_path.compare(log_path.size() - 6, 6, ".jsonl") == 0;
  const std::string stem = jsonl ? log_path.substr(0, log_path.size() - 6) : log_path;
  std::string path = stem + ".config.json";
  for (int n = 2; io::exists(path); ++n) path = stem + ".config-" + std::to_string(n) + ".json";
  try {
    io::OutputFile out(path);
    const std::string text = given_flags_json(a);
    out.write(text.data(), text.size());
    out.close();
  } catch (const std::exception& e) {  // a usage error, which every rank stops on
    throw UsageError(std::string("--log: the flags beside it: ") + e.what());
  }
  return path;
}

std::string train_help_text() {
  TrainArgs defaults;
  std::string out =
      "usage: fsdp-train [flags]   (launch with fsdp-run, mpirun or torchrun; --flag V or --flag=V)\n"
      "Trains a Llama-style decoder with fully sharded data parallelism: each block\n"
      "and the root are fully_shard()ed, fused AdamW, warmup + cosine learning rate.\n"
      "Exit codes: 0 done, 2 a usage error (nothing started), 1 a failure during the run, 3 stopped by a\n"
      "signal with its state saved (run the same command with --resume to finish it).\n\n";
  const auto table = flags(defaults);
  for (int topic = 0; topic < static_cast<int>(std::size(kTopics)); ++topic) {
    out += std::string(topic ? "\n" : "") + kTopics[topic].title + " ([" + kTopics[topic].table + "]):\n";
    for (const auto& [name, f] : table) {
      if (static_cast<int>(f.topic) != topic) continue;
      char line[512];
      const std::string help = f.help + (f.value.current.empty() ? "" : " (default " + f.value.current + ")");
      std::snprintf(line, sizeof(line), "  %-32s %s\n", (name + (f.takes_value ? " V" : "")).c_str(), help.c_str());
      out += line;
    }
  }
  return out + "  --help                           this text\n"
               "  --version                        fsdp.cpp's version\n";
}

model::LlamaConfig model_config(const TrainArgs& a) {
  const bool from_hf = model::has_hf_config(a.init_from);
  auto config = from_hf ? model::read_hf_config(a.init_from) : model::LlamaConfig::preset(a.model);
  // The flag ties any preset's head; it never unties one whose model ties (3b, as Llama-3.2-3B).
  if (!from_hf) config.tie_embeddings = config.tie_embeddings || a.tie_embeddings;
  config.recompute_blocks = a.recompute;
  config.attention = model::attention_kernel_named(a.attention);
  config.block_causal = a.attention_mask == "block_causal";
  if (a.eos_id >= 0) config.eos_token_ids = {a.eos_id};
  config.float8 = float8_recipe_named(a.fp8);
  config.float8_all_gather = a.fp8_all_gather && !a.cpu_offload;  // offloaded groups gather in bf16
  config.seed = a.seed;
  return config;
}

std::string model_name(const TrainArgs& a) { return model::has_hf_config(a.init_from) ? a.init_from : a.model; }

void check_train_args_on_this_machine(const TrainArgs& a) {
  if (!a.tensorboard.empty()) check_metrics_writer(kTensorboardWriter);
  if (!a.wandb.empty()) check_metrics_writer(kWandbWriter);
  if (!a.init_from.empty()) {
    require(io::exists(a.init_from), "--init-from: '" + a.init_from + "' does not exist");
    if (model::has_hf_config(a.init_from)) {
      try {
        model::read_hf_config(a.init_from);
      } catch (const std::invalid_argument& e) {
        throw UsageError(std::string("--init-from: ") + e.what());
      }
      for (const char* flag : {"--model", "--tie-embeddings"})
        require(!a.given.count(flag), std::string(flag) + " would be ignored: '" + a.init_from +
                                          "/config.json' gives the model (and whether its embeddings are tied); "
                                          "drop " + flag);
    }
  }
  const auto config = model_config(a);  // read once: --init-from's config.json is a file
  require(a.seq <= config.max_seq,
          "--seq " + std::to_string(a.seq) + " is more than the " + model_name(a) + " model's " +
              std::to_string(config.max_seq) + " positions" +
              (model::has_hf_config(a.init_from) ? " (max_position_embeddings in its config.json)" : "") +
              ": lower --seq");
  require(!config.block_causal || !config.eos_token_ids.empty(),
          "--attention-mask block_causal needs the id that ends a document, and the " + model_name(a) +
              " model names none: pass --eos-id ID (the tokenizer's eos_token_id, which fsdp-prepare-data puts "
              "after each document)");
  for (int64_t id : config.eos_token_ids)
    require(!config.block_causal || id < config.vocab,
            "--eos-id " + std::to_string(id) + " is outside the " + model_name(a) + " model's vocabulary of " +
                std::to_string(config.vocab) + " ids");
  const double gpu = a.backend == "mpi" ? -1 : smallest_gpu_bytes();  // CPU ranks: no GPU
  const bool on_gpu = gpu > 0;
  require(on_gpu || a.memory_snapshot.empty(),
          "--memory-snapshot records the GPU allocator's history, and this run has no GPU: drop it "
          "(--memory-log samples host memory)");
  require(on_gpu || a.attention == "aten", "--attention " + a.attention + " chooses a GPU kernel, and this run has "
                                           "no GPU: drop it");
  if (on_gpu && a.fp8 != "off") {
    try {
      check_float8_device(c10::Device(c10::kCUDA, 0));
    } catch (const std::invalid_argument& e) {
      throw UsageError(std::string("--fp8 ") + a.fp8 + ": " + e.what());
    }
    require(a.batch * a.seq % 16 == 0, "--fp8: float8 GEMMs need --batch x --seq a multiple of 16 (" +
                                           std::to_string(a.batch * a.seq) + " now)");
  }
  check_outputs_apart(a);
  if (!a.export_path.empty()) check_export_path(a);
  const auto resumed = check_resume(a);
  if (!a.save_dir.empty()) check_save_dir(a, resumed);
  if (a.data != "synthetic") check_data("--data", a.data, a, config.vocab, 1, "lower --seq or use more data");
  if (!a.eval_data.empty())  // the set is its first --eval-batches x --batch sequences
    check_data("--eval-data", a.eval_data, a, config.vocab, int64_t(a.eval_batches) * a.batch,
               "lower --eval-batches (" + std::to_string(a.eval_batches) + ") or use more held-out data");
  if (a.log.empty())
    require_writable_directory("--log", "runs");  // the default log's parent, made by rank 0
  else
    require_writable("--log", a.log);
  if (!a.save_init.empty()) require_writable("--save-init", a.save_init);
  for (const auto& [flag, prefix, extension] : per_rank_outputs(a))
    if (!prefix.empty()) require_writable(flag, rank_path(prefix, 0, extension));
  check_memory(a, config, gpu);
}

std::string default_log_path(const std::string& run_id) {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char time[32];
  std::strftime(time, sizeof(time), "%Y%m%d-%H%M%S", &local);
  return "runs/" + std::string(time) + "-" + run_id + "/fsdp-train.jsonl";
}

std::string recorded_data(const std::string& data) { return data == "synthetic" ? data : io::canonical_path(data); }

std::vector<PerRankOutput> per_rank_outputs(const TrainArgs& a) {
  return {{"--trace", a.trace, ".json"},
          {"--profile", a.profile, ".json"},
          {"--memory-log", a.memory_log, ".jsonl"},
          {"--memory-snapshot", a.memory_snapshot, ".pickle"}};
}

std::string rank_path(const std::string& prefix, int rank, const std::string& extension) {
  return prefix + "-rank" + std::to_string(rank) + extension;
}

}  // namespace fsdp::train
