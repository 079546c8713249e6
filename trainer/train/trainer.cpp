#include "train/trainer.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/serialize.h>

#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/stack.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <thread>

#include <unistd.h>

#include "fsdp/memory_stats.h"
#include "io/files.h"
#include "model/fused_ops.h"
#include "model/hf_llama.h"
#include "train/evaluate.h"
#include "train/lineage.h"
#include "train/llama_schedule.h"
#include "train/memory.h"
#include "train/profile.h"
#include "train/progress_line.h"

namespace fsdp::train {
namespace {

// Runs a save or load of `state` with `line` told its bytes; the line erased after, error or not.
template <class F>
void with_progress(CheckpointState& state, ProgressLine& line, F&& work) {
  struct Untold {  // on the way out, returned or thrown
    CheckpointState& state;
    ProgressLine& line;
    ~Untold() {
      state.progress = nullptr;
      line.end();
    }
  } untold{state, line};
  state.progress = line.callback();
  work();
}

volatile sig_atomic_t g_stop_signal = 0;
const auto g_process_start = std::chrono::steady_clock::now();

void stop_at_next_step(int sig) { g_stop_signal = sig; }

double seconds_since(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

std::shared_ptr<Communicator> init_communicator(const TrainArgs& args) {
  InitOptions init;
  init.backend = args.backend == "mpi" ? Backend::Mpi : args.backend == "nccl" ? Backend::Nccl : Backend::Auto;
  if (args.timeout_s > 0) init.timeout = std::chrono::milliseconds(static_cast<long long>(args.timeout_s * 1000));
  return fsdp::init(init);
}

// Full weights by name, as a dict torch.load() reads (the PyTorch reference benchmark starts from
// the same weights). Collective; rank 0 writes.
void save_weights(torch::nn::Module& model, const std::string& path, bool lead) {
  const auto parameters = model.named_parameters();
  c10::Dict<std::string, at::Tensor> weights;
  for (auto& [name, tensor] : full_state_dict(model))
    if (parameters.contains(name)) weights.insert(name, tensor.cpu());  // parameters only, no buffers
  if (!lead) return;
  const auto bytes = torch::pickle_save(c10::IValue(weights));
  write_file(path, std::string(bytes.begin(), bytes.end()));
}

// Whether every rank's parameters are finite: a collective check before anything is saved or
// exported, so that no run writes NaN weights (a divergence the loss did not show yet included).
bool parameters_finite(torch::nn::Module& model, Communicator& comm) {
  at::Tensor bad = at::zeros({1}, at::TensorOptions(at::kFloat).device(comm.device()));
  for (const auto& p : model.parameters())
    if (p.numel() > 0) bad += p.detach().isfinite().logical_not().any().to(at::kFloat);
  return comm.count_ranks(bad.item<float>() > 0) == 0;
}

// A run's identity, recorded in each checkpoint it saves: rank 0 draws it, every rank learns it.
std::string new_run_id(Communicator& comm) {
  at::Tensor id = at::zeros({1}, at::TensorOptions(at::kLong));
  if (comm.rank() == 0)
    id.fill_(static_cast<int64_t>(std::random_device{}() & 0x7fffffffu) << 16 ^ (getpid() & 0xffff));
  id = id.to(comm.device());
  comm.all_reduce(id, ReduceOp::Sum);
  char text[24];
  std::snprintf(text, sizeof(text), "%012llx", static_cast<unsigned long long>(id.item<int64_t>()));
  return text;
}

// The lock file that claims a --save-dir for one run at a time; it names its holder.
constexpr const char* kSaveDirLock = ".fsdp-train.lock";

std::string first_line_of(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string holder_description(const std::string& run_id) {
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  return "run " + run_id + ", pid " + std::to_string(getpid()) + " on " + host;
}

// How a message writes a number that may not be finite.
std::string number_text(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return std::to_string(v);
}

// --cpu-offload steps AdamW on the host: each rank of this host takes its share of the cores
// (ATen's default, every core for every rank, oversubscribes them).
void share_host_cores() {
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / local_ranks()));
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action{};
  action.sa_handler = stop_at_next_step;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGUSR1, SIGHUP}) sigaction(sig, &action, nullptr);
}

Trainer::Trainer(const TrainArgs& args)
    : args_(args),
      comm_(init_communicator(args)),
      lead_(comm_->rank() == 0),
      device_(comm_->device()),
      config_(model_config(args)),
      lr_schedule_{args.lr, args.min_lr, args.warmup, args.steps} {
  // The run's identity first: a resumed run keeps its checkpoint's (read by every rank).
  if (!args.resume.empty()) {
    resume_from_ = newest_checkpoint(args.resume);
    const auto recorded = checkpoint_extra(resume_from_);
    run_id_ = run_of(recorded);
    const auto flags = recorded.find("flags");
    const std::string changes = flags == recorded.end() ? "" : changed_flags(flags->second, args);
    if (lead_ && !changes.empty())
      std::printf("fsdp-train: %s was saved with other flags than this run's: %s\n", resume_from_.c_str(),
                  changes.c_str());
  }
  if (run_id_.empty()) run_id_ = new_run_id(*comm_);
  claim_outputs();
  data_rank_ = {comm_->rank() / args.tp, comm_->world_size() / args.tp, comm_->rank() % args.tp == 0};
  data_ = args.data == "synthetic" ? synthetic_tokens(config_.vocab, args.seq, args.seed)
                                   : file_tokens(data_files(args.data), args.seq, args.seed, SampleOrder::Shuffled);
  if (!args.eval_data.empty())  // the same sequences, in file order, for every evaluation
    eval_data_ = file_tokens(data_files(args.eval_data), args.seq, args.seed, SampleOrder::InOrder);
  set_runtime_options(args.runtime);
  if (plans_schedule(args) && device_.is_cpu()) count_host_allocations();  // the profile's memory, on CPU
  shard_model();
  resume();
  if (lead_ && !args.save_dir.empty() && !resume_from_.empty()) set_aside_abandoned_branch();
  release_cached_memory(device_);  // measure what the model holds, not set-up leftovers
  if (lead_) print_banner();
  take_memory_peaks(device_);
  stats_before_ = runtime_stats();
  if (!args.memory_log.empty())
    sampler_ = std::make_unique<MemorySampler>(device_, rank_path(args.memory_log, comm_->rank(), ".jsonl"));
  if (!args.memory_snapshot.empty()) start_memory_history(device_);  // a GPU: checked up front
  if (plans_schedule(args)) planned_.emplace(args, model_, device_, first_step_);
  trace_step_ = planned_ ? planned_->first_step_after() : std::min(1, args.steps - 1);
  // --max-skipped-steps: the gradient norm is needed for the check even without clipping.
  clip_norm_ = args.clip > 0 ? args.clip : skips_nonfinite_steps(args) ? std::numeric_limits<double>::infinity() : 0.0;
}

Trainer::~Trainer() = default;

// The model with deferred parameters (each rank allocates only its shards, which reset_parameters
// or the imported weights fill after sharding, with values that do not depend on the number of
// ranks), sharded under the schedule's groups; then the optimizer and its state.
void Trainer::shard_model() {
  model::Placement where{device_, /*deferred=*/true, /*mesh=*/{}};  // the mesh below where there is one
  if (args_.replicas > 1 || args_.tp > 1) {  // HSDP, tensor parallelism
    const Mesh mesh = make_mesh(args_.replicas, comm_, args_.tp);
    shard_.comm = mesh.shard;
    if (args_.replicas > 1) shard_.replicate = mesh.replicate;
    where.mesh = mesh;
  }
  model_ = model::Llama(config_, where);
  shard_.reshard_after_forward = args_.reshard_after_forward;
  shard_.cpu_offload = args_.cpu_offload;
  shard_.keep_compute_shards = args_.keep_compute_shards;
  if (args_.cpu_offload && device_.is_cuda()) share_host_cores();  // for the host optimizer
  shard_.mixed_precision.param_dtype = dtype_named(args_.param_dtype, device_.is_cuda());
  shard_.mixed_precision.reduce_dtype = dtype_named(args_.reduce_dtype, device_.is_cuda());
  // One GPU rank reduces nothing: its gradients in the param dtype hold exactly the values a
  // float32 reduce-scatter would give. Kept as they are, the hand-off copies nothing and the AdamW
  // kernel reads them as those float32 values: the same step, without the float32 gradients'
  // memory and bytes (on the 3B, 6.4 GB). Not with gradient accumulation, whose sums would round
  // in the param dtype.
  if (device_.is_cuda() && comm_->world_size() == 1 && args_.replicas <= 1 && !args_.cpu_offload &&
      args_.grad_accum == 1 && *shard_.mixed_precision.param_dtype == at::kBFloat16 && model::have_fused_kernels()) {
    shard_.mixed_precision.reduce_dtype = at::kBFloat16;
    shard_.mixed_precision.keep_low_precision_grads = true;
  }
  auto make_optimizer = [&] {
    return std::make_unique<FusedAdamW>(
        model_->parameters(), torch::optim::AdamWOptions(args_.lr).betas({0.9, 0.95}).weight_decay(args_.weight_decay));
  };
  if (args_.optimizer_before_shard) optimizer_ = make_optimizer();
  auto first_schedule = llama_schedule(config_, args_.reshard_after_forward, args_.runtime);
  if (plans_schedule(args_))  // the step before the profile runs with the least memory too: every block recomputed
    std::fill(first_schedule.recompute.begin() + 1, first_schedule.recompute.end(), true);
  shard_with_schedule(model_, first_schedule, shard_);
  if (args_.init_from.empty()) {
    ProgressLine line("initialising the weights", lead_);  // an 8B's shards take seconds
    model_->reset_parameters(line.callback());
  } else {
    ProgressLine line("reading weights from " + args_.init_from, lead_);
    model::load_hf_weights(*model_, args_.init_from, line.callback());
    line.end();
    if (lead_) std::printf("fsdp-train: weights from %s (rank 0 read %s)\n", args_.init_from.c_str(), line.moved().c_str());
  }
  if (!args_.save_init.empty()) save_weights(*model_, args_.save_init, lead_);
  if (!optimizer_) optimizer_ = make_optimizer();
  // Long-lived buffers first, next to the sharded parameters, before activations split the pool.
  optimizer_->init_state();
  if (args_.optimizer_in_backward)
    set_step_in_backward(model_, [this](const std::vector<at::Tensor>& params) { optimizer_->step_params(params); });
  allocate_library_workspaces(device_);
  checkpoint_ = model_state(*model_);
  optimizer_->add_to_checkpoint(checkpoint_, model_->named_parameters().pairs());
}

// Rank 0 claims what the run writes before any work: the --save-dir (its lock file names this
// run) and the log, each under an exclusive lock held until the process ends. If another run holds
// either, or the log holds another run's steps, every rank stops with that usage error (exit 2):
// two runs never overwrite each other's step-N or interleave one log, and a log is never emptied
// (a resumed run of its lineage appends).
void Trainer::claim_outputs() {
  std::string refusal;
  if (lead_) {
    try {
      if (!args_.save_dir.empty()) {
        io::make_directories(args_.save_dir);
        const std::string lock = args_.save_dir + "/" + kSaveDirLock;
        save_dir_lock_ = io::LockedFile::open(lock);
        if (!save_dir_lock_)
          throw UsageError("--save-dir: '" + args_.save_dir + "' is in use by another run (" + first_line_of(lock) +
                           "): wait for it to end, or save elsewhere");
        save_dir_lock_->rewrite(holder_description(run_id_) + "\n");
      }
      LogOwner owner{run_id_, std::nullopt, args_.overwrite_log};
      if (!resume_from_.empty()) owner.resumed_from = std::atoi(checkpoint_extra(resume_from_)["step"].c_str());
      step_log_.emplace(args_.log.empty() ? default_log_path(run_id_) : args_.log, owner, args_.log_every);
      const std::string flags_file = write_given_flags(args_, step_log_->path());
      if (!flags_file.empty())
        std::printf("fsdp-train: the flags given are in %s (--config reads them back)\n", flags_file.c_str());
      if (!args_.tensorboard.empty()) step_log_->add_writer(kTensorboardWriter, args_.tensorboard);
      if (!args_.wandb.empty()) {  // the run's id names it; its config is the flags given
        std::vector<std::string> options = {"--name", run_id_};
        if (!flags_file.empty()) options.insert(options.end(), {"--config", flags_file});
        step_log_->add_writer(kWandbWriter, args_.wandb, options);
      }
    } catch (const UsageError& e) {
      refusal = e.what();
    }
  }
  if (comm_->count_ranks(!refusal.empty()) > 0) throw UsageError(refusal);  // "" on the ranks that only learn of it
}

// --resume: the newest checkpoint's state and step. A checkpoint that cannot be loaded leaves
// the model as it was (load_checkpoint checks everything first); the error names the next older
// checkpoint, the one to fall back to.
void Trainer::resume() {
  if (!resume_from_.empty()) {
    const auto begin = std::chrono::steady_clock::now();
    ProgressLine line("loading " + resume_from_, lead_);
    try {
      with_progress(checkpoint_, line, [&] { load_checkpoint(resume_from_, checkpoint_); });
    } catch (const std::exception& e) {
      const auto saved = saved_checkpoints(io::parent_of(resume_from_));
      const auto failed = std::find_if(saved.begin(), saved.end(), [&](const SavedCheckpoint& c) {
        return io::canonical_path(c.path) == io::canonical_path(resume_from_);
      });
      const std::string older = failed != saved.end() && failed != saved.begin() ? std::prev(failed)->path : "";
      throw std::runtime_error(error_text(e) + (older.empty() ? "" : "; the next older checkpoint is '" + older +
                                                                          "': --resume " + older + " resumes from it"));
    }
    first_step_ = std::stoi(checkpoint_.extra.at("step"));
    // The data goes on at the sample after the checkpoint's last, whatever the batch was (a
    // checkpoint from before samples were recorded: its steps at this run's batch).
    const auto samples = checkpoint_.extra.find("samples");
    first_sample_ = samples != checkpoint_.extra.end() ? std::stoll(samples->second) : first_step_ * global_batch();
    if (lead_)
      std::printf("fsdp-train: resumed from %s (step %d, run %s) in %.2f s (rank 0 read %s, each block twice: "
                  "checked, then copied)\n",
                  resume_from_.c_str(), first_step_, run_id_.c_str(), seconds_since(begin), line.moved().c_str());
  }
  steps_done_ = first_step_;
}

// A resume from an older step of this run than the save directory's newest starts a new branch:
// the old branch's later checkpoints go aside, where no --resume takes them, but nothing is lost.
void Trainer::set_aside_abandoned_branch() {
  const std::string aside = train::set_aside_abandoned_branch(args_.save_dir, run_id_, first_step_);
  if (!aside.empty())
    std::printf("fsdp-train: %s holds this run's checkpoints after step %d, a branch this resume leaves: moved to "
                "%s\n", args_.save_dir.c_str(), first_step_, aside.c_str());
}

void Trainer::print_banner() const {
  std::printf("fsdp-train: %d rank(s), %s on %s | model %s (%.2fM parameters) | batch %d x %lld x %lld "
              "tokens per %s | param %s, reduce %s",
              comm_->world_size(), comm_->backend(), device_.str().c_str(), model_name(args_).c_str(),
              config_.parameter_count() / 1e6, args_.grad_accum, (long long)args_.batch, (long long)args_.seq,
              args_.tp > 1 ? "tp group" : "rank",
              c10::toString(*shard_.mixed_precision.param_dtype), c10::toString(*shard_.mixed_precision.reduce_dtype));
  if (shard_.mixed_precision.keep_low_precision_grads) std::printf(" (one rank: gradients kept in it, nothing to reduce)");
  if (config_.block_causal) {
    std::string ends;
    for (int64_t id : config_.eos_token_ids) ends += (ends.empty() ? "" : ", ") + std::to_string(id);
    std::printf(" | attention within documents (ended by id %s)", ends.c_str());
  }
  if (const int64_t epoch = data_->epoch_samples(); epoch > 0)
    std::printf(" | data: an epoch is %lld sequences, %.1f steps%s", (long long)epoch, double(epoch) / double(global_batch()),
                first_sample_ > 0 ? (", going on at sample " + std::to_string(first_sample_)).c_str() : "");
  if (args_.replicas > 1) std::printf(" | HSDP: %d replicas of %d", args_.replicas, comm_->world_size() / args_.replicas);
  if (args_.tp > 1) std::printf(" | tensor parallel: %d ranks a layer", args_.tp);
  if (args_.cpu_offload) std::printf(" | CPU offload (%d threads a rank)", at::get_num_threads());
  if (args_.keep_compute_shards) std::printf(" | compute shards kept");
  if (args_.optimizer_in_backward) std::printf(" | optimizer in backward");
  if (config_.float8 != Float8Recipe::Off)
    std::printf(" | float8 %s (weights gathered in %s)", args_.fp8.c_str(),
                config_.float8 == Float8Recipe::Tensorwise && config_.float8_all_gather ? "float8" : "the param dtype");
  if (device_.is_cuda())
    std::printf(" | attention %s | allocator '%s'", args_.attention.c_str(), std::getenv("PYTORCH_CUDA_ALLOC_CONF"));
  std::printf("\n");
}

int Trainer::train() {
  for (int step = first_step_; step < args_.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const double lr = lr_schedule_.at(step);
    for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    if (!args_.trace.empty() && step == trace_step_) start_trace();
    if (!args_.profile.empty() && step == std::max(0, args_.steps - args_.profile_steps)) start_profile(device_);
    at::RecordFunction step_scope(at::RecordScope::USER_SCOPE);  // the step's span in a profile
    if (step_scope.isActive()) step_scope.before("ProfilerStep#" + std::to_string(step + 1));

    const StepOutcome outcome = read_step(train_step(step, planned_ ? planned_->before_step(step) : nullptr), start);
    const int done = steps_done_ = step + 1;
    // A log that could not be written (found by the previous step's report) stops the run here,
    // saved like a stop by a signal: its work is kept, and the run ends with the error.
    const bool stop = outcome.stop_requested || outcome.log_failed || done == args_.stop_at_step;
    if (planned_) planned_->after_step(step, outcome.ms);
    report(step, outcome, lr, stop);
    if (!goes_on_after_nonfinite(done, outcome)) break;
    if (planned_) {
      // .item(): the device is idle after each step the plan check trains
      const auto next = planned_->report_and_plan(step, [&] { train_step(step, nullptr).loss.item<double>(); }, lead_);
      if (next == PlannedRun::Next::BudgetRefused) exit_code_ = 2;
      if (next != PlannedRun::Next::Train) break;
    }
    const bool save_now = stop || done == args_.steps || (args_.save_every > 0 && done % args_.save_every == 0);
    if (!args_.save_dir.empty() && save_now) {
      if (!state_is_finite(done, "saved")) {
        exit_code_ = 1;
        break;
      }
      // The last save and a stopping one are made whole before the run ends.
      save(done, args_.async_save && !stop && done != args_.steps);
    }
    if (stop) {
      if (lead_)
        std::printf("fsdp-train: stopped after step %d (%s)%s\n", done,
                    outcome.log_failed ? "the log cannot be written" : outcome.stop_requested ? "a signal" : "--stop-at-step",
                    args_.save_dir.empty() ? "; nothing saved: no --save-dir" : "");
      if (outcome.log_failed) {
        if (lead_) std::fprintf(stderr, "fsdp-train: error: %s\n", log_error_.c_str());
        exit_code_ = 1;
        break;
      }
      // Stopped by a signal: with its state saved, kStoppedResumable (requeue the command with
      // --resume); with nothing saved, the signal's exit code, as if it had ended us.
      if (outcome.stop_requested)
        exit_code_ = args_.save_dir.empty() ? 128 + (g_stop_signal ? g_stop_signal : SIGTERM) : kStoppedResumable;
      break;
    }
  }
  if (first_step_ >= args_.steps && lead_)  // the checks let this through only with --export
    std::printf("fsdp-train: the checkpoint is at step %d of --steps %d: nothing to train\n", first_step_, args_.steps);
  return finish();
}

Trainer::StepResult Trainer::train_step(int step, PlannedRun::StartRecording start_recording) {
  optimizer_->zero_grad();
  // --grad-accum K: rank r's rows of the step's global batch are K micro-batches of --batch
  // rows, the same rows one step of K x --batch rows would take.
  at::Tensor loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (int micro = 0; micro < args_.grad_accum; ++micro) {
    if (args_.grad_accum > 1 && args_.grad_accum_sync == "last")
      set_requires_gradient_sync(model_, micro == args_.grad_accum - 1);
    if (start_recording && micro == args_.grad_accum - 1) start_recording();  // the planner records one pass
    const int64_t first_row = (int64_t(data_rank_.index) * args_.grad_accum + micro) * args_.batch;
    auto tokens = data_->samples(samples_before(step) + first_row, args_.batch).to(device_);
    auto inputs = tokens.narrow(1, 0, args_.seq), targets = tokens.narrow(1, 1, args_.seq);
    auto micro_loss = forward(model_, inputs, targets) / args_.grad_accum;  // fused head + loss
    micro_loss.backward();
    loss += micro_loss.detach();
  }
  // The clip is applied by the optimizer as it reads the gradients: a divisor instead of a pass.
  StepResult result{loss, clip_norm_ > 0 ? grad_norm(*model_) : at::Tensor()};
  const at::Tensor grad_divisor = result.grad_norm.defined() ? clip_divisor(result.grad_norm, clip_norm_) : at::Tensor();
  if (skips_nonfinite_steps(args_)) {  // one host wait: step only where every rank's loss and the global norm are finite
    at::Tensor bad = (loss.isfinite() & result.grad_norm.isfinite()).logical_not().to(at::kFloat).reshape({1});
    comm_->all_reduce(bad, ReduceOp::Sum);
    result.skipped = bad.item<float>() > 0;
  }
  if (!args_.optimizer_in_backward && !result.skipped)  // else stepped in backward
    optimizer_->step_with_grad_divisor(grad_divisor);
  return result;
}

// The loss and whether any rank was asked to stop, in one all-reduce: every rank stops together.
// `start`: when the step began; its time runs to the end of this wait.
Trainer::StepOutcome Trainer::read_step(const StepResult& result, std::chrono::steady_clock::time_point start) {
  const auto flag = [&](double v) { return at::scalar_tensor(v, result.loss.options().dtype(at::kFloat)); };
  auto loss_and_stop = at::stack({result.loss, flag(g_stop_signal), flag(log_error_.empty() ? 0 : 1)});
  comm_->all_reduce(loss_and_stop, ReduceOp::Sum);
  const auto totals = loss_and_stop.cpu();  // also waits for the GPU
  StepOutcome outcome;
  outcome.loss = totals[0].item<double>() / comm_->world_size();
  outcome.stop_requested = totals[1].item<double>() > 0;
  outcome.log_failed = totals[2].item<double>() > 0;
  if (result.grad_norm.defined()) outcome.grad_norm = result.grad_norm.item<double>();
  outcome.skipped = result.skipped;
  outcome.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return outcome;
}

void Trainer::report(int step, const StepOutcome& outcome, double lr, bool stop) {
  const int done = step + 1;
  if (sampler_) sampler_->mark_step(done, outcome.loss);
  if (!args_.trace.empty() && (step == args_.trace_steps || step == args_.steps - 1))
    write_trace(rank_path(args_.trace, comm_->rank(), ".json"));
  auto mem = take_memory_peaks(device_);
  if (planned_) mem.allocated_gib = planned_->peak_allocated_gib(step, mem.allocated_gib);
  const auto stats = runtime_stats();
  const RuntimeStats waits = counted_between(stats_before_, stats);
  stats_before_ = stats;
  if (lead_ && step == first_step_)
    std::printf("fsdp-train: start-up %.1f s (process start to the end of the first step, %.1f s of it the "
                "step); host peak memory %.2f GiB on rank 0\n",
                seconds_since(g_process_start), outcome.ms / 1000, peak_resident_gib());
  std::optional<EvalResult> eval;
  if (eval_data_ && (done == args_.steps || stop || (args_.eval_every > 0 && done % args_.eval_every == 0)))
    eval = evaluate(model_, *comm_, data_rank_, *eval_data_, int64_t(args_.eval_batches) * args_.batch, args_.batch);
  if (step_log_ && log_error_.empty()) {
    try {
      step_log_->write({done, args_.steps, outcome.loss, lr, outcome.grad_norm, outcome.skipped, outcome.ms,
                        global_batch() * args_.seq, samples_before(done), data_->epoch_samples(),
                        config_.flops_per_token(args_.seq), mem, waits, device_.is_cuda(),
                        args_.optimizer_in_backward && args_.cpu_offload, comm_->world_size(), model_name(args_), eval});
    } catch (const std::exception& e) {  // a full disk, a file size limit: the next step saves and stops
      log_error_ = e.what();
    }
  }
}

// A step whose loss or gradient norm is not finite stops the run, unless --max-skipped-steps let
// it skip its optimizer step (the state is then still the last finite one).
bool Trainer::goes_on_after_nonfinite(int done, const StepOutcome& outcome) {
  const double grad_norm = outcome.grad_norm.value_or(0.0);
  if (std::isfinite(outcome.loss) && std::isfinite(grad_norm)) return true;
  const std::string what = "step " + std::to_string(done) + ": the loss is " + number_text(outcome.loss) +
                           (outcome.grad_norm ? " and the gradient norm " + number_text(grad_norm) : "");
  if (outcome.skipped && ++skipped_steps_ <= args_.max_skipped_steps) {
    if (lead_)
      std::printf("fsdp-train: %s: skipped, no optimizer step (%d of --max-skipped-steps %d)\n", what.c_str(),
                  skipped_steps_, args_.max_skipped_steps);
    return true;
  }
  if (lead_)
    std::fprintf(stderr, "fsdp-train: error: %s%s: training diverged; nothing saved or exported after it. "
                 "Lower --lr (%g now)%s\n", what.c_str(),
                 outcome.skipped ? (" (past --max-skipped-steps " + std::to_string(args_.max_skipped_steps) + ")").c_str()
                                 : "",
                 args_.lr,
                 outcome.skipped || args_.optimizer_in_backward ? "" : ", or skip such steps with --max-skipped-steps N");
  exit_code_ = 1;
  return false;
}

// Before anything is written: no NaN or infinite weights leave the run.
bool Trainer::state_is_finite(int done, const char* action) {
  if (parameters_finite(*model_, *comm_)) return true;
  if (lead_)
    std::fprintf(stderr, "fsdp-train: error: after step %d the parameters hold NaN or infinite values: training "
                 "diverged; not %s. Lower --lr (%g now)\n", done, action, args_.lr);
  return false;
}

void Trainer::save(int steps_done, bool in_background) {
  checkpoint_.extra = {{"step", std::to_string(steps_done)}, {"samples", std::to_string(samples_before(steps_done))},
                       {"model", model_name(args_)},
                       {"seed", std::to_string(args_.seed)}, {"data", recorded_data(args_.data)}, {"run", run_id_},
                       {"flags", given_flags_json(args_)}};
  const std::string dir = args_.save_dir + "/" + checkpoint_name(steps_done);
  // Another run's step-N is replaced only where the user said so (--overwrite-checkpoints);
  // every rank reads the metadata alike.
  if (!args_.overwrite_checkpoints && io::exists(dir + "/metadata.bin") && run_of(checkpoint_extra(dir)) != run_id_)
    throw std::runtime_error("'" + dir + "' was written by another run; not replaced. Its run id is in its "
                             "metadata: resume that run there, save this one elsewhere, or pass --overwrite-checkpoints");
  finish_pending_save();  // checkpoints are published in step order
  const auto begin = std::chrono::steady_clock::now();
  if (in_background) {
    pending_save_ = start_checkpoint_save(dir, checkpoint_);
    pending_since_ = std::chrono::steady_clock::now();
    if (lead_)
      std::printf("fsdp-train: saving %s in the background (copied to host memory in %.2f s)\n", dir.c_str(),
                  seconds_since(begin));
    return;
  }
  ProgressLine line("saving " + dir, lead_);
  with_progress(checkpoint_, line, [&] { save_checkpoint(dir, checkpoint_); });
  if (lead_) std::printf("fsdp-train: saved %s in %.2f s (rank 0 wrote %s)\n", dir.c_str(), seconds_since(begin), line.moved().c_str());
  after_saved();
}

void Trainer::finish_pending_save() {
  if (!pending_save_) return;
  const std::unique_ptr<CheckpointWrite> write = std::move(pending_save_);
  write->finish();
  if (lead_)
    std::printf("fsdp-train: saved %s (written in the background, published %.2f s after its copy)\n",
                write->dir().c_str(), seconds_since(pending_since_));
  after_saved();
}

void Trainer::after_saved() {
  // --overwrite-checkpoints: the other runs' checkpoints go once this run has one of its own.
  if (lead_ && args_.overwrite_checkpoints && !replaced_other_runs_) {
    const auto others = other_runs(saved_checkpoints(args_.save_dir), run_id_);
    for (const auto& c : others) io::remove_tree(c.path);
    if (!others.empty())
      std::printf("fsdp-train: --overwrite-checkpoints: removed %zu checkpoint(s) of other runs from %s\n",
                  others.size(), args_.save_dir.c_str());
  }
  replaced_other_runs_ = true;
  // --keep-last: the run's older checkpoints go once the new one is complete (published
  // after rank 0 wrote its metadata, last).
  if (lead_ && args_.keep_last > 0) {
    const auto older = older_than_newest(saved_checkpoints(args_.save_dir), run_id_, args_.keep_last);
    for (const auto& c : older) io::remove_tree(c.path);
    if (!older.empty())
      std::printf("fsdp-train: --keep-last %d: removed %zu older checkpoint(s), up to %s\n", args_.keep_last,
                  older.size(), older.back().path.c_str());
  }
}

int Trainer::finish() {
  finish_pending_save();  // a run that stopped early (diverged, a plan refused) keeps its last save
  if (!log_error_.empty() && exit_code_ == 0) {  // the last step's line: saved, but the run failed
    std::fprintf(stderr, "fsdp-train: error: %s\n", log_error_.c_str());
    exit_code_ = 1;
  }
  const bool failed = exit_code_ == 1 || exit_code_ == 2;  // diverged, a budget refused, the log lost
  if (!args_.export_path.empty() && !failed) {
    if (steps_done_ < args_.steps) {
      // A stop before --steps (a signal, --stop-at-step) is no finished model: the export is the
      // one the run that finishes writes, the requeued command with --resume.
      if (lead_)
        std::printf("fsdp-train: not exported: the run stopped at step %d of %d; the same command with --resume "
                    "finishes it and exports to %s\n",
                    steps_done_, args_.steps, args_.export_path.c_str());
    } else if (state_is_finite(steps_done_, "exported")) {
      model::ExportOptions options;
      options.imported_from = args_.init_from;
      options.dtype = args_.export_dtype == "auto" ? model::imported_dtype(args_.init_from)
                                                   : dtype_named(args_.export_dtype, /*on_gpu=*/false);
      options.max_file_bytes = static_cast<int64_t>(args_.export_shard_gb * 1e9);
      options.writer = run_id_;
      options.replace = args_.overwrite_export;
      ProgressLine line("exporting " + args_.export_path, lead_);
      options.progress = line.callback();
      model::export_hf(*model_, *comm_, args_.export_path, options);
      line.end();
      if (lead_)
        std::printf("fsdp-train: exported %s (Hugging Face LlamaForCausalLM names, %s; %s)\n", args_.export_path.c_str(),
                    options.dtype == at::kBFloat16 ? "bf16" : "fp32", line.moved().c_str());
    } else {
      exit_code_ = 1;
    }
  }
  if (!args_.profile.empty()) save_profile(rank_path(args_.profile, comm_->rank(), ".json"));
  if (!args_.memory_snapshot.empty()) write_memory_snapshot(device_, rank_path(args_.memory_snapshot, comm_->rank(), ".pickle"));
  if (sampler_) sampler_->close();
  if (step_log_) {
    const std::string wrote = step_log_->close_writers();
    std::printf("fsdp-train: %s, log in %s%s\n", exit_code_ == 0 && steps_done_ >= args_.steps ? "done" : "stopped",
                step_log_->path().c_str(),
                wrote.c_str());
  }
  shutdown();
  return exit_code_;
}

}  // namespace fsdp::train
