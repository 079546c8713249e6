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
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>

#include "fsdp/fsdp.h"
#include "shard/memory_stats.h"
#include "io/files.h"
#include "model/hf_llama.h"
#include "model/llama.h"
#include "train/args.h"
#include "train/budget_plan.h"
#include "train/data.h"
#include "train/evaluate.h"
#include "train/fused_adamw.h"
#include "train/memory.h"
#include "train/memory_sampler.h"
#include "train/profile.h"
#include "train/schedule.h"
#include "train/sharding_plan.h"

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
  if (!args.resume.empty()) {
    const std::string from = fsdp::newest_checkpoint(args.resume);
    const auto begin = std::chrono::steady_clock::now();
    fsdp::load_checkpoint(from, checkpoint);
    first_step = std::stoi(checkpoint.extra.at("step"));
    if (lead)
      std::printf("fsdp-train: resumed from %s (step %d) in %.2f s\n", from.c_str(), first_step,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  if (lead && !args.save_dir.empty()) fsdp::io::make_directories(args.save_dir);
  auto save = [&](int steps_done) {
    checkpoint.extra = {{"step", std::to_string(steps_done)}, {"model", args.model}, {"seed", std::to_string(args.seed)},
                        {"data", args.data}};
    const std::string dir = args.save_dir + "/" + fsdp::checkpoint_name(steps_done);
    const auto begin = std::chrono::steady_clock::now();
    fsdp::save_checkpoint(dir, checkpoint);
    if (lead)
      std::printf("fsdp-train: saved %s in %.2f s\n", dir.c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  };
  fsdp::train::LrSchedule schedule{args.lr, args.min_lr, args.warmup, args.steps};
  fsdp::train::release_cached_memory(device);  // measure what the model holds, not set-up leftovers

  std::ofstream log;
  const std::string log_path = args.log.empty() ? fsdp::train::default_log_path() : args.log;
  auto check_log = [&] {
    if (!log) throw std::runtime_error("cannot write the log '" + log_path + "'");
  };
  if (lead) {
    if (args.log.empty()) fsdp::io::make_directories(fsdp::io::parent_of(log_path));
    log.open(log_path);
    log.precision(9);  // enough to compare runs (resume, resharding) step by step
    check_log();
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
  const auto mem_label = device.is_cuda() ? "peak alloc/reserved" : "peak rss";
  fsdp::train::take_memory_peaks(device);
  auto stats_before = fsdp::runtime_stats();
  auto output = [&](const std::string& prefix, const char* extension) {
    return fsdp::train::rank_path(prefix, comm->rank(), extension);
  };
  std::unique_ptr<fsdp::train::MemorySampler> sampler;
  if (!args.memory_log.empty())
    sampler = std::make_unique<fsdp::train::MemorySampler>(device, output(args.memory_log, ".jsonl"));
  if (!args.memory_snapshot.empty() && !fsdp::train::start_memory_history(device) && lead)
    std::printf("fsdp-train: --memory-snapshot needs a GPU; ignored\n");
  int exit_code = 0;
  // --memory-budget / --plan-check: after the first step, two under the profiling schedule (the
  // first timed untraced, the second profiled), then two at prefetch depth 1 (the first, where the
  // allocator grows its pool, timed untraced; the second calibrates the contention); then the plan
  // is made. The fits take the untraced times: recording costs host time (fsdp::finish_profiled_step).
  const int profiling_warmup_step = planning ? first_step + 1 : -1;
  const int profiled_step = planning ? first_step + 2 : -1;
  const int calibration_warmup_step = planning ? profiled_step + 1 : -1;
  const int calibration_step = planning ? profiled_step + 2 : -1;
  double warmup_ms = 0;  // the last warm-up step's time
  const int trace_step = planning ? calibration_step + 1 : std::min(1, args.steps - 1);
  // One optimizer step; returns the (micro-batch summed) loss and the gradient norm, on the device.
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
    const at::Tensor grad_norm_on_device = args.clip > 0 ? fsdp::clip_grad_norm_(*model, args.clip) : at::Tensor();
    if (!args.optimizer_in_backward) optimizer->step();  // else each group stepped in backward
    return std::make_pair(loss, grad_norm_on_device);
  };
  std::optional<fsdp::plan::CostModel> profile;
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
    if (step == profiling_warmup_step) fsdp::train::apply_schedule(model, fsdp::profiling_schedule(*model));
    if (step == calibration_warmup_step) fsdp::train::apply_schedule(model, fsdp::calibration_schedule(*model));
    const auto [loss, grad_norm_on_device] =
        train_step(step, step == profiled_step      ? fsdp::start_profiled_step
                         : step == calibration_step ? fsdp::start_calibration_step
                                                    : nullptr);

    // The loss and whether any rank was asked to stop, in one all-reduce: every rank stops together.
    auto loss_and_stop = at::stack({loss,
                                    at::scalar_tensor(static_cast<double>(g_stop_signal), loss.options().dtype(at::kFloat))});
    comm->all_reduce(loss_and_stop, fsdp::ReduceOp::Sum);
    const auto totals = loss_and_stop.cpu();  // also waits for the GPU
    const double loss_value = totals[0].item<double>() / comm->world_size();
    const bool stop_requested = totals[1].item<double>() > 0;
    const double grad_norm = grad_norm_on_device.defined() ? grad_norm_on_device.item<double>() : 0.0;
    if (step == profiled_step)
      profile = fsdp::finish_profiled_step(*model, warmup_ms, args.grad_accum, args.grad_accum_sync == "every");
    if (step == calibration_step) fsdp::finish_calibration_step(*model, *profile, warmup_ms);
    if (sampler) sampler->mark_step(step + 1, loss_value);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (step == profiling_warmup_step || step == calibration_warmup_step) warmup_ms = ms;
    const int64_t tokens_per_step = args.grad_accum * args.batch * args.seq * comm->world_size();
    const double tok_s = tokens_per_step / (ms / 1000.0);
    if (!args.trace.empty() && (step == args.trace_steps || step == args.steps - 1))
      fsdp::write_trace(output(args.trace, ".json"));
    auto mem = fsdp::train::take_memory_peaks(device);
    if (step == profiled_step)  // its marks restarted the allocator's peak: the profile has the step's
      mem.allocated_gib = std::max(mem.allocated_gib, profile->profiled_peak_bytes / double(int64_t(1) << 30));
    const auto stats = fsdp::runtime_stats();
    const long ag_waits = stats.allgather_waits - stats_before.allgather_waits;
    const long rs_waits = stats.reduce_scatter_waits - stats_before.reduce_scatter_waits;
    const long host_step_waits = stats.host_step_waits - stats_before.host_step_waits;
    const long prefetches = stats.prefetches - stats_before.prefetches;
    stats_before = stats;
    const int done = step + 1;
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
    if (lead) {
      std::printf("step %4d/%d | loss %.4f | lr %.2e | grad norm %.3f | %8.0f tok/s | %7.1f ms | %s %.2f",
                  step + 1, args.steps, loss_value, lr, grad_norm, tok_s, ms, mem_label,
                  mem.allocated_gib);
      if (device.is_cuda()) std::printf("/%.2f", mem.reserved_gib);
      std::printf(" GiB | waits ag %ld rs %ld", ag_waits, rs_waits);
      if (args.optimizer_in_backward && args.cpu_offload) std::printf(" host steps %ld", host_step_waits);
      std::printf("\n");
      if (eval)
        std::printf("eval after step %d | loss %.4f | perplexity %.2f | %lld tokens\n", done, eval->loss,
                    eval->perplexity, (long long)eval->tokens);
      std::fflush(stdout);
      log << "{\"step\":" << step + 1 << ",\"loss\":" << loss_value << ",\"lr\":" << lr
          << ",\"grad_norm\":" << grad_norm << ",\"tok_s\":" << tok_s << ",\"step_ms\":" << ms
          << ",\"peak_alloc_gib\":" << mem.allocated_gib << ",\"peak_reserved_gib\":" << mem.reserved_gib
          << ",\"peak_active_gib\":" << mem.active_gib << ",\"alloc_retries\":" << mem.alloc_retries
          << ",\"allgather_waits\":" << ag_waits << ",\"reduce_scatter_waits\":" << rs_waits
          << ",\"host_step_waits\":" << host_step_waits
          << ",\"prefetches\":" << prefetches << ",\"tokens_per_step\":" << tokens_per_step
          << ",\"flops_per_token\":" << config.flops_per_token(args.seq)
          << ",\"alloc_end_bytes\":" << mem.allocated_now_bytes << ",\"reserved_end_bytes\":" << mem.reserved_now_bytes
          << ",\"rss_gib\":" << mem.rss_now_gib
          << ",\"world\":" << comm->world_size() << ",\"model\":\"" << args.model << "\"";
      if (eval) log << ",\"eval_loss\":" << eval->loss << ",\"eval_ppl\":" << eval->perplexity;
      log << "}\n";
      log.flush();
      check_log();
    }
    if (step == profiled_step && lead)
      std::printf("%s", fsdp::train::profile_report(*profile, fsdp::profiling_schedule(*model)).c_str());
    if (step == calibration_step) {
      if (lead)
        std::printf("%s", fsdp::train::contention_report(*profile, fsdp::calibration_schedule(*model)).c_str());
      if (!args.plan_check.empty()) {
        // .item(): the device is idle after each step
        auto one_step = [&] { train_step(step, nullptr).first.item<double>(); };
        const fsdp::train::PlanCheck check{args.plan_check_budgets, args.plan_check_steps, args.plan_check_rounds,
                                           fsdp::train::smallest_gpu_bytes(), args.plan_check};
        fsdp::train::check_plans(model, *profile, one_step, device, check, lead);
        if (lead) std::printf("fsdp-train: plan check written to %s\n", args.plan_check.c_str());
        break;
      }
      const auto budget = static_cast<int64_t>(args.memory_budget_gib * double(int64_t(1) << 30));
      fsdp::plan::Plan plan;
      try {
        plan = fsdp::plan_for_budget(*model, budget, *profile);
      } catch (const fsdp::plan::BudgetTooSmall& e) {
        if (lead)
          std::fprintf(stderr, "fsdp-train: error: --memory-budget: %s%s\n", e.what(),
                       args.cpu_offload || !device.is_cuda() ? ""
                                                             : " (--cpu-offload moves the sharded state to the host)");
        exit_code = 2;
        break;
      }
      if (lead) std::printf("%s", fsdp::train::plan_report(plan, *profile, budget).c_str());
      if (args.plan_only) break;
      fsdp::train::apply_schedule(model, plan.chosen.schedule);
    }
    if (!args.save_dir.empty() && (stop || done == args.steps || (args.save_every > 0 && done % args.save_every == 0)))
      save(done);
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
  if (!args.export_path.empty()) {
    fsdp::model::export_hf(*model, *comm, args.export_path);
    if (lead) std::printf("fsdp-train: exported %s (Hugging Face LlamaForCausalLM names)\n", args.export_path.c_str());
  }
  if (!args.profile.empty()) fsdp::train::save_profile(output(args.profile, ".json"));
  if (!args.memory_snapshot.empty()) fsdp::train::write_memory_snapshot(device, output(args.memory_snapshot, ".pickle"));
  if (sampler) sampler->close();
  if (lead) {
    log.close();
    check_log();
    std::printf("fsdp-train: done, log in %s\n", log_path.c_str());
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
    if (launch_rank() == 0)
      std::printf("fsdp-train: dry run: the flags, files and memory check out for --model %s, %lld x %lld tokens "
                  "per rank, %d steps; nothing trained\n",
                  args.model.c_str(), (long long)args.batch, (long long)args.seq, args.steps);
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
