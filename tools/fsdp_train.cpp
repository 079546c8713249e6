// fsdp-train: trains the Llama-style example model with fsdp.cpp.
//   fsdp-run -n 2 build/fsdp-train --model tiny --steps 20
#include <ATen/record_function.h>
#include <torch/nn/functional/loss.h>
#include <torch/serialize.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>

#include "fsdp/fsdp.h"
#include "model/llama.h"
#include "train/data.h"
#include "train/fused_adamw.h"
#include "train/memory.h"
#include "train/memory_sampler.h"
#include "train/profile.h"
#include "train/schedule.h"

namespace {

struct Args {
  std::string model = "tiny";
  int steps = 20;
  int64_t batch = 4;  // per rank
  int64_t seq = 128;
  double lr = 3e-3, min_lr = 3e-4, weight_decay = 0.1, clip = 1.0;
  int warmup = 5;
  uint64_t seed = 1234;
  std::string data = "synthetic";
  std::string param_dtype = "auto", reduce_dtype = "fp32";
  bool reshard_after_forward = true, tie_embeddings = false, checkpoint = false;
  std::string backend = "auto";
  std::string log = "fsdp-train.jsonl";
  double timeout_s = 0;
  fsdp::RuntimeOptions runtime;
  std::string save_init;  // file for the initial full weights (rank 0)
  std::string trace, memory_snapshot, memory_log;
  bool optimizer_before_shard = false;
  int trace_steps = 2;
  std::string profile;
  int profile_steps = 2;
};

struct Flag {
  std::string help;
  std::function<void(const std::string&)> set;
  bool takes_value = true;
};

std::map<std::string, Flag> flags(Args& a) {
  auto num = [](auto& field) {
    return [&field](const std::string& v) {
      std::istringstream in(v);
      if (!(in >> field) || !in.eof()) throw std::invalid_argument("not a number: '" + v + "'");
    };
  };
  auto str = [](std::string& field) { return [&field](const std::string& v) { field = v; }; };
  return {
      {"--model", {"preset: tiny, small, 1b, 8b (default tiny)", str(a.model)}},
      {"--steps", {"training steps (default 20)", num(a.steps)}},
      {"--batch", {"sequences per rank per step (default 4)", num(a.batch)}},
      {"--seq", {"tokens per sequence (default 128)", num(a.seq)}},
      {"--lr", {"peak learning rate (default 3e-3)", num(a.lr)}},
      {"--min-lr", {"final learning rate of the cosine decay (default 3e-4)", num(a.min_lr)}},
      {"--warmup", {"linear warmup steps (default 5)", num(a.warmup)}},
      {"--weight-decay", {"AdamW weight decay (default 0.1)", num(a.weight_decay)}},
      {"--clip", {"global gradient-norm clip, 0 = off (default 1.0)", num(a.clip)}},
      {"--seed", {"seed for weights and data (default 1234)", num(a.seed)}},
      {"--data", {"'synthetic' or a text file read as bytes (default synthetic)", str(a.data)}},
      {"--param-dtype", {"all-gather/compute dtype: fp32, bf16, auto = bf16 on GPU (default auto)",
                         str(a.param_dtype)}},
      {"--reduce-dtype", {"reduce-scatter dtype: fp32, bf16 (default fp32)", str(a.reduce_dtype)}},
      {"--no-reshard-after-forward",
       {"keep blocks unsharded from forward to backward", [&a](const std::string&) {
          a.reshard_after_forward = false;
        }, false}},
      {"--tie-embeddings",
       {"share the embedding matrix with the output head",
        [&a](const std::string&) { a.tie_embeddings = true; }, false}},
      {"--checkpoint",
       {"activation checkpointing: recompute every block in backward",
        [&a](const std::string&) { a.checkpoint = true; }, false}},
      {"--backend", {"auto, mpi (CPU) or nccl (GPU) (default auto)", str(a.backend)}},
      {"--log", {"JSONL log written by rank 0 (default fsdp-train.jsonl)", str(a.log)}},
      {"--timeout", {"seconds a collective may wait (default 300, or FSDP_TIMEOUT_S)",
                     num(a.timeout_s)}},
      {"--prefetch-depth", {"groups all-gathered ahead of use, from the recorded order (default 1)",
                            num(a.runtime.prefetch_depth)}},
      {"--max-inflight-allgathers",
       {"all-gathers the CPU may run ahead of the GPU, 0 = unlimited (default 2)",
        num(a.runtime.max_inflight_allgathers)}},
      {"--max-inflight-reduce-scatters",
       {"reduce-scatters in flight before the CPU waits, 0 = unlimited (default 2)",
        num(a.runtime.max_inflight_reduce_scatters)}},
      {"--bucket-mb", {"groups below this size (MB) share one collective, 0 = off (default 0)",
                       num(a.runtime.bucket_mb)}},
      {"--trace", {"Chrome trace of steps 2.. (see --trace-steps) to PATH-rankR.json", str(a.trace)}},
      {"--trace-steps", {"steps the trace covers, from the second (default 2)", num(a.trace_steps)}},
      {"--profile", {"PyTorch profiler (kineto) trace of the last --profile-steps steps: CPU ops and "
                     "GPU kernels per stream, to PATH-rankR.json", str(a.profile)}},
      {"--profile-steps", {"steps the profile covers, at the end of the run (default 2)",
                           num(a.profile_steps)}},
      {"--memory-snapshot",
       {"GPU: allocator history of the run to PATH-rankR.pickle (pytorch.org/memory_viz)",
        str(a.memory_snapshot)}},
      {"--memory-log", {"sample memory every 10 ms into PATH-rankR.jsonl, with step markers",
                        str(a.memory_log)}},
      {"--optimizer-before-shard",
       {"create AdamW before fully_shard (trains the same: the parameters are sharded in place)",
        [&a](const std::string&) { a.optimizer_before_shard = true; }, false}},
      {"--save-init", {"write the initial full weights here (torch.load-able; for benchmarks)",
                       str(a.save_init)}},
  };
}

void print_help(std::map<std::string, Flag>& table) {
  std::cout << "usage: fsdp-train [flags]   (launch with fsdp-run, mpirun or torchrun)\n"
               "Trains a Llama-style decoder with fully sharded data parallelism: each block\n"
               "and the root are fully_shard()ed, fused AdamW, warmup + cosine learning rate.\n\n";
  for (auto& [name, f] : table)
    std::printf("  %-28s %s\n", (name + (f.takes_value ? " V" : "")).c_str(), f.help.c_str());
  std::cout << "  --help                       this text\n";
}

Args parse(int argc, char** argv) {
  Args a;
  auto table = flags(a);
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i];
    if (name == "--help" || name == "-h") {
      print_help(table);
      std::exit(0);
    }
    auto it = table.find(name);
    if (it == table.end()) throw std::invalid_argument("unknown flag " + name + " (see --help)");
    std::string value;
    if (it->second.takes_value) {
      if (i + 1 >= argc) throw std::invalid_argument(name + " needs a value");
      value = argv[++i];
    }
    try {
      it->second.set(value);
    } catch (const std::exception& e) {
      throw std::invalid_argument(name + ": " + e.what());
    }
  }
  if (a.steps < 1 || a.batch < 1 || a.seq < 1) throw std::invalid_argument("--steps, --batch, --seq must be positive");
  return a;
}

c10::ScalarType dtype_named(const std::string& name, bool on_gpu) {
  if (name == "fp32") return torch::kFloat;
  if (name == "bf16") return torch::kBFloat16;
  if (name == "auto") return on_gpu ? torch::kBFloat16 : torch::kFloat;
  throw std::invalid_argument("dtype must be fp32, bf16 or auto, not '" + name + "'");
}

// Full weights by name, as a dict torch.load() reads (the PyTorch reference
// benchmark starts from the same weights).
void save_weights(torch::nn::Module& model, const std::string& path) {
  c10::Dict<std::string, at::Tensor> weights;
  for (const auto& item : model.named_parameters()) weights.insert(item.key(), item.value().detach().cpu());
  auto bytes = torch::pickle_save(c10::IValue(weights));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void train(const Args& args) {
  fsdp::InitOptions init;
  init.backend = args.backend == "mpi"    ? fsdp::Backend::Mpi
                 : args.backend == "nccl" ? fsdp::Backend::Nccl
                                          : fsdp::Backend::Auto;
  if (args.timeout_s > 0)
    init.timeout = std::chrono::milliseconds(static_cast<long long>(args.timeout_s * 1000));
  auto comm = fsdp::init(init);
  const bool lead = comm->rank() == 0;
  const c10::Device device = comm->device();

  auto config = fsdp::model::LlamaConfig::preset(args.model);
  config.tie_embeddings = args.tie_embeddings;
  config.checkpoint_blocks = args.checkpoint;
  config.max_seq = std::max(config.max_seq, args.seq);
  auto data = args.data == "synthetic" ? fsdp::train::synthetic_tokens(config.vocab, args.seed)
                                       : fsdp::train::file_tokens(args.data, args.seed);
  if (args.data != "synthetic" && config.vocab < 256)
    throw std::invalid_argument("--data FILE needs a vocabulary of at least 256 byte tokens");

  fsdp::set_runtime_options(args.runtime);
  fsdp::train::require_host_memory(4.0 * config.parameter_count(),
                                   "the " + args.model + " model's float32 weights, built whole before sharding,");
  torch::manual_seed(args.seed);  // same initial weights on every rank
  fsdp::model::Llama model(config);
  if (lead && !args.save_init.empty()) save_weights(*model, args.save_init);
  model->to(device);
  fsdp::ShardOptions shard;
  shard.reshard_after_forward = args.reshard_after_forward;
  shard.mixed_precision.param_dtype = dtype_named(args.param_dtype, device.is_cuda());
  shard.mixed_precision.reduce_dtype = dtype_named(args.reduce_dtype, device.is_cuda());
  auto make_optimizer = [&] {
    return std::make_unique<fsdp::train::FusedAdamW>(
        model->parameters(),
        torch::optim::AdamWOptions(args.lr).betas({0.9, 0.95}).weight_decay(args.weight_decay));
  };
  std::unique_ptr<fsdp::train::FusedAdamW> optimizer;
  if (args.optimizer_before_shard) optimizer = make_optimizer();
  for (auto& block : model->blocks) fsdp::fully_shard(block, shard);
  fsdp::fully_shard(model, shard);
  if (!optimizer) optimizer = make_optimizer();
  // Long-lived buffers first, next to the sharded parameters, before activations split the pool.
  optimizer->init_state();
  fsdp::train::allocate_library_workspaces(device);
  fsdp::train::LrSchedule schedule{args.lr, args.min_lr, args.warmup, args.steps};
  fsdp::train::release_cached_memory(device);  // measure what the model holds, not set-up leftovers

  std::ofstream log;
  if (lead) {
    log.open(args.log);
    std::printf("fsdp-train: %d rank(s), %s on %s | model %s (%.2fM parameters) | batch %lld x %lld "
                "tokens per rank | param %s, reduce %s",
                comm->world_size(), comm->backend(), device.str().c_str(), args.model.c_str(),
                config.parameter_count() / 1e6, (long long)args.batch, (long long)args.seq,
                c10::toString(*shard.mixed_precision.param_dtype),
                c10::toString(*shard.mixed_precision.reduce_dtype));
    if (device.is_cuda()) std::printf(" | allocator '%s'", std::getenv("PYTORCH_CUDA_ALLOC_CONF"));
    std::printf("\n");
  }
  const auto mem_label = device.is_cuda() ? "peak alloc/reserved" : "peak rss";
  fsdp::train::take_memory_peaks(device);
  auto stats_before = fsdp::runtime_stats();
  const std::string rank_suffix = "-rank" + std::to_string(comm->rank());
  std::unique_ptr<fsdp::train::MemorySampler> sampler;
  if (!args.memory_log.empty())
    sampler = std::make_unique<fsdp::train::MemorySampler>(device, args.memory_log + rank_suffix + ".jsonl");
  if (!args.memory_snapshot.empty() && !fsdp::train::start_memory_history(device) && lead)
    std::printf("fsdp-train: --memory-snapshot needs a GPU; ignored\n");
  for (int step = 0; step < args.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const double lr = schedule.at(step);
    for (auto& group : optimizer->param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    if (!args.trace.empty() && step == std::min(1, args.steps - 1)) fsdp::start_trace();
    if (!args.profile.empty() && step == std::max(0, args.steps - args.profile_steps))
      fsdp::train::start_profile(device);
    at::RecordFunction step_scope(at::RecordScope::USER_SCOPE);  // the step's span in a profile
    if (step_scope.isActive()) step_scope.before("ProfilerStep#" + std::to_string(step + 1));
    auto tokens = data->rows(step, comm->rank() * args.batch, args.batch, args.seq).to(device);
    auto inputs = tokens.narrow(1, 0, args.seq), targets = tokens.narrow(1, 1, args.seq);

    optimizer->zero_grad();
    auto logits = fsdp::forward(model, inputs);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}).to(torch::kFloat),
                                                     targets.reshape({-1}));
    loss.backward();
    const at::Tensor grad_norm_on_device = args.clip > 0 ? fsdp::clip_grad_norm_(*model, args.clip) : at::Tensor();
    optimizer->step();

    auto global_loss = loss.detach().clone();
    comm->all_reduce(global_loss, fsdp::ReduceOp::Avg);
    const double loss_value = global_loss.item<double>();  // also waits for the GPU
    const double grad_norm = grad_norm_on_device.defined() ? grad_norm_on_device.item<double>() : 0.0;
    if (sampler) sampler->mark_step(step + 1, loss_value);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const double tok_s = args.batch * args.seq * comm->world_size() / (ms / 1000.0);
    if (!args.trace.empty() && (step == args.trace_steps || step == args.steps - 1))
      fsdp::write_trace(args.trace + rank_suffix + ".json");
    const auto mem = fsdp::train::take_memory_peaks(device);
    const auto stats = fsdp::runtime_stats();
    const long ag_waits = stats.allgather_waits - stats_before.allgather_waits;
    const long rs_waits = stats.reduce_scatter_waits - stats_before.reduce_scatter_waits;
    const long prefetches = stats.prefetches - stats_before.prefetches;
    stats_before = stats;
    if (!lead) continue;
    std::printf("step %4d/%d | loss %.4f | lr %.2e | grad norm %.3f | %8.0f tok/s | %7.1f ms | %s %.2f",
                step + 1, args.steps, loss_value, lr, grad_norm, tok_s, ms, mem_label,
                mem.allocated_gib);
    if (device.is_cuda()) std::printf("/%.2f", mem.reserved_gib);
    std::printf(" GiB | waits ag %ld rs %ld\n", ag_waits, rs_waits);
    std::fflush(stdout);
    log << "{\"step\":" << step + 1 << ",\"loss\":" << loss_value << ",\"lr\":" << lr
        << ",\"grad_norm\":" << grad_norm << ",\"tok_s\":" << tok_s << ",\"step_ms\":" << ms
        << ",\"peak_alloc_gib\":" << mem.allocated_gib << ",\"peak_reserved_gib\":" << mem.reserved_gib
        << ",\"peak_active_gib\":" << mem.active_gib << ",\"alloc_retries\":" << mem.alloc_retries
        << ",\"allgather_waits\":" << ag_waits << ",\"reduce_scatter_waits\":" << rs_waits
        << ",\"prefetches\":" << prefetches << ",\"tokens_per_step\":" << args.batch * args.seq * comm->world_size()
        << ",\"flops_per_token\":" << config.flops_per_token(args.seq)
        << ",\"world\":" << comm->world_size() << ",\"model\":\"" << args.model << "\"}\n";
  }
  if (!args.profile.empty()) fsdp::train::save_profile(args.profile + rank_suffix + ".json");
  if (!args.memory_snapshot.empty())
    fsdp::train::write_memory_snapshot(device, args.memory_snapshot + rank_suffix + ".pickle");
  if (lead) std::printf("fsdp-train: done, log in %s\n", args.log.c_str());
  fsdp::shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything touches CUDA: expandable segments let the caching
  // allocator grow one mapping instead of keeping fixed segments, so memory
  // activations free is reused at any size (1B model: reserved/allocated
  // 1.069 -> 1.023, bench/results/2026-11-22-h200x2-3cf0cd8). A value in the
  // environment, even empty, wins.
  setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", /*overwrite=*/0);
  try {
    train(parse(argc, argv));
  } catch (const std::exception& e) {
    fsdp::abort_job(std::string("fsdp-train: error: ") + e.what());
  }
  return 0;
}
