// fsdp-train: trains the Llama-style example model with fsdp.cpp.
//   fsdp-run -n 2 build/fsdp-train --model tiny --steps 20
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/serialize.h>

#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/stack.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <optional>
#include <random>
#include <thread>

#include <unistd.h>

#include "fsdp/fsdp.h"
#include "fsdp/memory_stats.h"
#include "io/files.h"
#include "model/hf_llama.h"
#include "model/llama.h"
#include "train/args.h"
#include "train/data.h"
#include "train/evaluate.h"
#include "train/fused_adamw.h"
#include "train/llama_schedule.h"
#include "train/lr_schedule.h"
#include "train/memory.h"
#include "train/memory_sampler.h"
#include "train/planned_run.h"
#include "train/profile.h"
#include "train/step_log.h"

namespace {

// Full weights by name, as a dict torch.load() reads (the PyTorch reference benchmark starts from
// the same weights). Collective; rank 0 writes.
void save_weights(torch::nn::Module& model, const std::string& path, bool lead) {
  const auto parameters = model.named_parameters();
  c10::Dict<std::string, at::Tensor> weights;
  for (auto& [name, tensor] : fsdp::full_state_dict(model))
    if (parameters.contains(name)) weights.insert(name, tensor.cpu());  // parameters only, no buffers
  if (!lead) return;
  const auto bytes = torch::pickle_save(c10::IValue(weights));
  fsdp::train::write_file(path, std::string(bytes.begin(), bytes.end()));
}

// SIGTERM, SIGINT or SIGUSR1 (a job scheduler's notice): finish the step, save, stop.
volatile sig_atomic_t g_stop_signal = 0;
const auto g_process_start = std::chrono::steady_clock::now();

void stop_at_next_step(int sig) { g_stop_signal = sig; }

void install_stop_handlers() {
  struct sigaction action{};
  action.sa_handler = stop_at_next_step;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaction(sig, &action, nullptr);
}

// The launch variables' rank (0 without a launcher), for messages printed before or without a
// communicator.
int launch_rank() {
  try {
    return fsdp::launch_env_from_process().rank;
  } catch (const std::exception&) {
    return 0;
  }
}

// Whether every rank's parameters are finite: a collective check before anything is saved or
// exported, so that no run writes NaN weights (a divergence the loss did not show yet included).
bool parameters_finite(torch::nn::Module& model, fsdp::Communicator& comm) {
  at::Tensor bad = at::zeros({1}, at::TensorOptions(at::kFloat).device(comm.device()));
  for (const auto& p : model.parameters())
    if (p.numel() > 0) bad += p.detach().isfinite().logical_not().any().to(at::kFloat);
  comm.all_reduce(bad, fsdp::ReduceOp::Sum);
  return bad.item<float>() == 0;
}

// A run's identity, recorded in each checkpoint it saves: rank 0 draws it, every rank learns it.
std::string new_run_id(fsdp::Communicator& comm) {
  at::Tensor id = at::zeros({1}, at::TensorOptions(at::kLong));
  if (comm.rank() == 0)
    id.fill_(static_cast<int64_t>(std::random_device{}() & 0x7fffffffu) << 16 ^ (getpid() & 0xffff));
  id = id.to(comm.device());
  comm.all_reduce(id, fsdp::ReduceOp::Sum);
  char text[24];
  std::snprintf(text, sizeof(text), "%012llx", static_cast<unsigned long long>(id.item<int64_t>()));
  return text;
}

// --overwrite: the checkpoints another run left in the save directory go before this run saves,
// so that a later --resume cannot take one of theirs.
void remove_checkpoints(const std::string& dir) {
  for (const auto& name : fsdp::io::list_directory(dir))
    if (name.rfind("step-", 0) == 0) fsdp::io::remove_tree(dir + "/" + name);
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
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / fsdp::train::local_ranks()));
}

int train(const fsdp::train::TrainArgs& args) {
  fsdp::InitOptions init;
  init.backend = args.backend == "mpi"    ? fsdp::Backend::Mpi
                 : args.backend == "nccl" ? fsdp::Backend::Nccl
                                          : fsdp::Backend::Auto;
  if (args.timeout_s > 0)
    init.timeout = std::chrono::milliseconds(static_cast<long long>(args.timeout_s * 1000));
  auto comm = fsdp::init(init);
  const bool lead = comm->rank() == 0;
  const c10::Device device = comm->device();

  const auto config = fsdp::train::model_config(args);
  auto data = args.data == "synthetic" ? fsdp::train::synthetic_tokens(config.vocab, args.seed)
                                       : fsdp::train::file_tokens(args.data, args.seed);
  auto eval_data = args.eval_data.empty() ? nullptr : fsdp::train::file_tokens(args.eval_data, args.seed);

  fsdp::set_runtime_options(args.runtime);
  const bool planning = fsdp::train::plans_schedule(args);
  if (planning && device.is_cpu()) fsdp::count_host_allocations();  // the profile's memory, on CPU
  // Parameters deferred: each rank allocates only its shards, which reset_parameters fills after
  // sharding with values that do not depend on the number of ranks.
  fsdp::model::Llama model(config, fsdp::model::Placement{device, /*deferred=*/true});
  fsdp::ShardOptions shard;
  if (args.replicas > 1) {  // HSDP
    const fsdp::Mesh mesh = fsdp::make_mesh(args.replicas, comm);
    shard.comm = mesh.shard;
    shard.replicate = mesh.replicate;
  }
  shard.reshard_after_forward = args.reshard_after_forward;
  shard.cpu_offload = args.cpu_offload;
  if (args.cpu_offload && device.is_cuda()) share_host_cores();  // for the host optimizer
  shard.mixed_precision.param_dtype = fsdp::train::dtype_named(args.param_dtype, device.is_cuda());
  shard.mixed_precision.reduce_dtype = fsdp::train::dtype_named(args.reduce_dtype, device.is_cuda());
  auto make_optimizer = [&] {
    return std::make_unique<fsdp::train::FusedAdamW>(
        model->parameters(),
        torch::optim::AdamWOptions(args.lr).betas({0.9, 0.95}).weight_decay(args.weight_decay));
  };
  std::unique_ptr<fsdp::train::FusedAdamW> optimizer;
  if (args.optimizer_before_shard) optimizer = make_optimizer();
  auto first_schedule = fsdp::train::llama_schedule(config, args.reshard_after_forward, args.runtime);
  if (planning)  // the step before the profile runs with the least memory too: every block checkpointed
    std::fill(first_schedule.checkpoint.begin() + 1, first_schedule.checkpoint.end(), true);
  fsdp::train::shard_with_schedule(model, first_schedule, shard);
  if (args.init_from.empty()) {
    model->reset_parameters();
  } else {
    fsdp::model::load_hf_weights(*model, args.init_from);
    if (lead) std::printf("fsdp-train: weights from %s\n", args.init_from.c_str());
  }
  if (!args.save_init.empty()) save_weights(*model, args.save_init, lead);
  if (!optimizer) optimizer = make_optimizer();
  // Long-lived buffers first, next to the sharded parameters, before activations split the pool.
  optimizer->init_state();
  if (args.optimizer_in_backward)
    fsdp::set_step_in_backward(model, [&optimizer](const std::vector<at::Tensor>& params) {
      optimizer->step_params(params);
    });
  fsdp::train::allocate_library_workspaces(device);
  fsdp::CheckpointState checkpoint = fsdp::model_state(*model);
  optimizer->add_to_checkpoint(checkpoint, model->named_parameters().pairs());
  int first_step = 0;
  std::string run_id;  // a resumed run keeps its checkpoints' id
  if (!args.resume.empty()) {
    const std::string from = fsdp::newest_checkpoint(args.resume);
    const auto begin = std::chrono::steady_clock::now();
    fsdp::load_checkpoint(from, checkpoint);
    first_step = std::stoi(checkpoint.extra.at("step"));
    if (checkpoint.extra.count("run")) run_id = checkpoint.extra.at("run");
    if (lead)
      std::printf("fsdp-train: resumed from %s (step %d%s) in %.2f s\n", from.c_str(), first_step,
                  run_id.empty() ? "" : (", run " + run_id).c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  if (run_id.empty()) run_id = new_run_id(*comm);
  if (lead && !args.save_dir.empty()) {
    fsdp::io::make_directories(args.save_dir);
    if (args.overwrite) remove_checkpoints(args.save_dir);
  }
  auto save = [&](int steps_done) {
    checkpoint.extra = {{"step", std::to_string(steps_done)}, {"model", fsdp::train::model_name(args)},
                        {"seed", std::to_string(args.seed)}, {"data", args.data}, {"run", run_id}};
    const std::string dir = args.save_dir + "/" + fsdp::checkpoint_name(steps_done);
    const auto begin = std::chrono::steady_clock::now();
    fsdp::save_checkpoint(dir, checkpoint);
    if (lead)
      std::printf("fsdp-train: saved %s in %.2f s\n", dir.c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  };
  fsdp::train::LrSchedule schedule{args.lr, args.min_lr, args.warmup, args.steps};
  fsdp::train::release_cached_memory(device);  // measure what the model holds, not set-up leftovers

  std::optional<fsdp::train::StepLog> step_log;  // rank 0's
  if (lead) {
    step_log.emplace(args.log.empty() ? fsdp::train::default_log_path() : args.log);
    std::printf("fsdp-train: %d rank(s), %s on %s | model %s (%.2fM parameters) | batch %d x %lld x %lld "
                "tokens per rank | param %s, reduce %s",
                comm->world_size(), comm->backend(), device.str().c_str(), fsdp::train::model_name(args).c_str(),
                config.parameter_count() / 1e6, args.grad_accum, (long long)args.batch, (long long)args.seq,
                c10::toString(*shard.mixed_precision.param_dtype),
                c10::toString(*shard.mixed_precision.reduce_dtype));
    if (args.replicas > 1) std::printf(" | HSDP: %d replicas of %d", args.replicas, comm->world_size() / args.replicas);
    if (args.cpu_offload) std::printf(" | CPU offload (%d threads a rank)", at::get_num_threads());
    if (args.optimizer_in_backward) std::printf(" | optimizer in backward");
    if (device.is_cuda())
      std::printf(" | attention %s | allocator '%s'", args.attention.c_str(), std::getenv("PYTORCH_CUDA_ALLOC_CONF"));
    std::printf("\n");
  }
  fsdp::train::take_memory_peaks(device);
  auto stats_before = fsdp::runtime_stats();
  auto output = [&](const std::string& prefix, const char* extension) {
    return fsdp::train::rank_path(prefix, comm->rank(), extension);
  };
  std::unique_ptr<fsdp::train::MemorySampler> sampler;
  if (!args.memory_log.empty())
    sampler = std::make_unique<fsdp::train::MemorySampler>(device, output(args.memory_log, ".jsonl"));
  if (!args.memory_snapshot.empty()) fsdp::train::start_memory_history(device);  // a GPU: checked up front
  int exit_code = 0;
  // --memory-budget / --plan-check: the planner's steps (train/planned_run.h).
  std::optional<fsdp::train::PlannedRun> planned;
  if (planning) planned.emplace(args, model, device, first_step);
  const int trace_step = planned ? planned->first_step_after() : std::min(1, args.steps - 1);
  // --max-skipped-steps: the gradient norm is needed for the check even without clipping.
  const bool skips = fsdp::train::skips_nonfinite_steps(args);
  const double clip_norm = args.clip > 0 ? args.clip : skips ? std::numeric_limits<double>::infinity() : 0.0;
  struct StepResult {
    at::Tensor loss, grad_norm;  // on the device: the (micro-batch summed) loss, the norm if computed
    bool skipped = false;        // --max-skipped-steps: not finite, no optimizer step taken
  };
  // One optimizer step.
  auto train_step = [&](int step, void (*start_recording)()) {
    optimizer->zero_grad();
    // --grad-accum K: rank r's rows of the step's global batch are K micro-batches of --batch
    // rows, the same rows one step of K x --batch rows would take.
    at::Tensor loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    for (int micro = 0; micro < args.grad_accum; ++micro) {
      if (args.grad_accum > 1 && args.grad_accum_sync == "last")
        fsdp::set_requires_gradient_sync(model, micro == args.grad_accum - 1);
      if (start_recording && micro == args.grad_accum - 1) start_recording();  // the planner records one pass
      const int64_t first_row = (int64_t(comm->rank()) * args.grad_accum + micro) * args.batch;
      auto tokens = data->rows(step, first_row, args.batch, args.seq).to(device);
      auto inputs = tokens.narrow(1, 0, args.seq), targets = tokens.narrow(1, 1, args.seq);
      auto micro_loss = fsdp::forward(model, inputs, targets) / args.grad_accum;  // fused head + loss
      micro_loss.backward();
      loss += micro_loss.detach();
    }
    StepResult result{loss, clip_norm > 0 ? fsdp::clip_grad_norm_(*model, clip_norm) : at::Tensor()};
    if (skips) {  // one host wait: step only where every rank's loss and the global norm are finite
      at::Tensor bad = (loss.isfinite() & result.grad_norm.isfinite()).logical_not().to(at::kFloat).reshape({1});
      comm->all_reduce(bad, fsdp::ReduceOp::Sum);
      result.skipped = bad.item<float>() > 0;
    }
    if (!args.optimizer_in_backward && !result.skipped) optimizer->step();  // else stepped in backward
    return result;
  };
  int skipped_steps = 0;
  int steps_done = first_step;  // the state's step: the checkpoint's, then each step's
  // Before anything is written: no NaN or infinite weights leave the run.
  auto state_is_finite = [&](int done, const char* action) {
    if (parameters_finite(*model, *comm)) return true;
    if (lead)
      std::fprintf(stderr, "fsdp-train: error: after step %d the parameters hold NaN or infinite values: training "
                   "diverged; not %s. Lower --lr (%g now)\n", done, action, args.lr);
    return false;
  };
  for (int step = first_step; step < args.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const double lr = schedule.at(step);
    for (auto& group : optimizer->param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    if (!args.trace.empty() && step == trace_step) fsdp::start_trace();
    if (!args.profile.empty() && step == std::max(0, args.steps - args.profile_steps))
      fsdp::train::start_profile(device);
    at::RecordFunction step_scope(at::RecordScope::USER_SCOPE);  // the step's span in a profile
    if (step_scope.isActive()) step_scope.before("ProfilerStep#" + std::to_string(step + 1));
    const auto [loss, grad_norm_on_device, skipped] = train_step(step, planned ? planned->before_step(step) : nullptr);

    // The loss and whether any rank was asked to stop, in one all-reduce: every rank stops together.
    auto loss_and_stop = at::stack({loss,
                                    at::scalar_tensor(static_cast<double>(g_stop_signal), loss.options().dtype(at::kFloat))});
    comm->all_reduce(loss_and_stop, fsdp::ReduceOp::Sum);
    const auto totals = loss_and_stop.cpu();  // also waits for the GPU
    const double loss_value = totals[0].item<double>() / comm->world_size();
    const bool stop_requested = totals[1].item<double>() > 0;
    const bool has_grad_norm = grad_norm_on_device.defined();
    const double grad_norm = has_grad_norm ? grad_norm_on_device.item<double>() : 0.0;
    const bool finite = std::isfinite(loss_value) && std::isfinite(grad_norm);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (planned) planned->after_step(step, ms);
    if (sampler) sampler->mark_step(step + 1, loss_value);
    if (!args.trace.empty() && (step == args.trace_steps || step == args.steps - 1))
      fsdp::write_trace(output(args.trace, ".json"));
    auto mem = fsdp::train::take_memory_peaks(device);
    if (planned) mem.allocated_gib = planned->peak_allocated_gib(step, mem.allocated_gib);
    const auto stats = fsdp::runtime_stats();
    const fsdp::RuntimeStats waits = fsdp::train::counted_between(stats_before, stats);
    stats_before = stats;
    const int done = step + 1;
    steps_done = done;
    if (lead && step == first_step)
      std::printf("fsdp-train: start-up %.1f s (process start to the end of the first step, %.1f s of it the "
                  "step); host peak memory %.2f GiB on rank 0\n",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - g_process_start).count(), ms / 1000,
                  fsdp::train::peak_resident_gib());
    const bool stop = stop_requested || done == args.stop_at_step;
    std::optional<fsdp::train::EvalResult> eval;
    if (eval_data && (done == args.steps || stop || (args.eval_every > 0 && done % args.eval_every == 0)))
      eval = fsdp::train::evaluate(model, *comm, *eval_data, int64_t(args.eval_batches) * args.batch, args.batch,
                                   args.seq);
    if (step_log)
      step_log->write({done, args.steps, loss_value, lr, has_grad_norm ? std::optional<double>(grad_norm) : std::nullopt,
                       skipped, ms, args.grad_accum * args.batch * args.seq * comm->world_size(),
                       config.flops_per_token(args.seq), mem, waits, device.is_cuda(),
                       args.optimizer_in_backward && args.cpu_offload, comm->world_size(), args.model, eval});
    if (!finite) {
      // Skipped steps took no optimizer step: the state is still the last finite one.
      const std::string what = "step " + std::to_string(done) + ": the loss is " + number_text(loss_value) +
                               (has_grad_norm ? " and the gradient norm " + number_text(grad_norm) : "");
      if (skipped && ++skipped_steps <= args.max_skipped_steps) {
        if (lead)
          std::printf("fsdp-train: %s: skipped, no optimizer step (%d of --max-skipped-steps %d)\n", what.c_str(),
                      skipped_steps, args.max_skipped_steps);
      } else {
        if (lead)
          std::fprintf(stderr, "fsdp-train: error: %s%s: training diverged; nothing saved or exported after it. "
                       "Lower --lr (%g now)%s\n", what.c_str(),
                       skipped ? (" (past --max-skipped-steps " + std::to_string(args.max_skipped_steps) + ")").c_str()
                               : "",
                       args.lr,
                       skipped || args.optimizer_in_backward ? "" : ", or skip such steps with --max-skipped-steps N");
        exit_code = 1;
        break;
      }
    }
    if (planned) {
      // .item(): the device is idle after each step the plan check trains
      const auto next = planned->report_and_plan(step, [&] { train_step(step, nullptr).loss.item<double>(); }, lead);
      if (next == fsdp::train::PlannedRun::Next::BudgetRefused) exit_code = 2;
      if (next != fsdp::train::PlannedRun::Next::Train) break;
    }
    const bool save_now = stop || done == args.steps || (args.save_every > 0 && done % args.save_every == 0);
    if (!args.save_dir.empty() && save_now) {
      if (!state_is_finite(done, "saved")) {
        exit_code = 1;
        break;
      }
      save(done);
    }
    if (stop) {
      if (lead)
        std::printf("fsdp-train: stopped after step %d (%s)%s\n", done,
                    stop_requested ? "a signal" : "--stop-at-step",
                    args.save_dir.empty() ? "; nothing saved: no --save-dir" : "");
      // Stopped by a signal with nothing saved: the signal's exit code, as if it had ended us.
      exit_code = stop_requested && args.save_dir.empty() ? 128 + (g_stop_signal ? g_stop_signal : SIGTERM) : 0;
      break;
    }
  }
  if (first_step >= args.steps && lead)  // the checks let this through only with --export
    std::printf("fsdp-train: the checkpoint is at step %d of --steps %d: nothing to train\n", first_step, args.steps);
  const bool failed = exit_code == 1 || exit_code == 2;  // diverged, or a budget refused
  if (!args.export_path.empty() && !failed) {
    if (state_is_finite(steps_done, "exported")) {
      fsdp::model::export_hf(*model, *comm, args.export_path, args.init_from);
      if (lead) std::printf("fsdp-train: exported %s (Hugging Face LlamaForCausalLM names)\n", args.export_path.c_str());
    } else {
      exit_code = 1;
    }
  }
  if (!args.profile.empty()) fsdp::train::save_profile(output(args.profile, ".json"));
  if (!args.memory_snapshot.empty()) fsdp::train::write_memory_snapshot(device, output(args.memory_snapshot, ".pickle"));
  if (sampler) sampler->close();
  if (step_log) {
    step_log->close();
    std::printf("fsdp-train: %s, log in %s\n", exit_code == 0 ? "done" : "stopped", step_log->path().c_str());
  }
  fsdp::shutdown();
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything touches CUDA: expandable segments let the caching
  // allocator grow one mapping instead of keeping fixed segments, so memory
  // activations free is reused at any size (1B model: reserved/allocated
  // 1.069 -> 1.023, bench/results/2026-11-22-h200x2-3cf0cd8). A value in the
  // environment, even empty, wins.
  setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", /*overwrite=*/0);
  fsdp::train::TrainArgs args;
  try {
    args = fsdp::train::parse_train_args(std::vector<std::string>(argv + 1, argv + argc));
    if (args.help) {
      std::cout << fsdp::train::train_help_text();
      return 0;
    }
    fsdp::train::check_train_args_on_this_machine(args);
  } catch (const fsdp::train::UsageError& e) {
    // Every rank finds the same error before any of them joins the others: one says it.
    if (launch_rank() == 0) std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
    return 2;
  }
  if (args.dry_run) {
    // What the run would be, as the run itself would take it: the model from --init-from's
    // config.json where it has one, the checkpoint --resume would continue, the outputs it would write.
    if (launch_rank() == 0) {
      const auto config = fsdp::train::model_config(args);
      std::string outputs;
      if (!args.resume.empty()) outputs += "; resumes " + fsdp::newest_checkpoint(args.resume);
      if (!args.save_dir.empty()) outputs += "; saves to " + args.save_dir;
      if (!args.export_path.empty()) outputs += "; exports to " + args.export_path;
      std::printf("fsdp-train: dry run: the flags, files and memory check out for the %s model (%.2fM parameters), "
                  "%lld x %lld tokens per rank, %d steps%s; nothing trained\n",
                  fsdp::train::model_name(args).c_str(), config.parameter_count() / 1e6, (long long)args.batch,
                  (long long)args.seq, args.steps, outputs.c_str());
    }
    return 0;
  }
  install_stop_handlers();
  try {
    return train(args);
  } catch (const std::exception& e) {
    fsdp::abort_job("fsdp-train: error on rank " + std::to_string(launch_rank()) + ": " + fsdp::error_text(e));
  }
  return 0;
}
