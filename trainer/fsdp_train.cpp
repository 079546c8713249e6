// fsdp-train: trains the Llama-style example model with fsdp.cpp.
//   fsdp-run -n 2 build/fsdp-train --model tiny --steps 20
// The command line is parsed and checked here; the run itself is train/trainer.h.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "fsdp/fsdp.h"
#include "train/args.h"
#include "train/cost_model_file.h"
#include "train/trainer.h"

namespace {

// The launch variables' rank (0 without a launcher), for messages printed before or without a
// communicator.
int launch_rank() {
  try {
    return fsdp::launch_env_from_process().rank;
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything touches CUDA: expandable segments let the caching
  // allocator grow one mapping instead of keeping fixed segments, so memory
  // activations free is reused at any size (1B model: reserved/allocated
  // 1.069 -> 1.023; docs/results.md). A value in the
  // environment, even empty, wins.
  setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", /*overwrite=*/0);
  // A stop request (SIGTERM, SIGINT, SIGUSR1) during start-up is kept for the first step boundary,
  // not fatal. A file over `ulimit -f` fails its write, which names the file, instead of SIGXFSZ
  // ending the rank without a word.
  fsdp::train::install_stop_handlers();
  std::signal(SIGXFSZ, SIG_IGN);
  // A --tensorboard or --wandb writer that died must not end the run: its pipe's writes fail instead.
  std::signal(SIGPIPE, SIG_IGN);
  fsdp::train::TrainArgs args;
  try {
    args = fsdp::train::parse_train_args(std::vector<std::string>(argv + 1, argv + argc));
    if (args.help || args.version) {
      std::cout << (args.help ? fsdp::train::train_help_text() : "fsdp-train " + std::string(fsdp::version()) + "\n");
      return 0;
    }
    if (!args.project.empty()) {  // arithmetic on a file: no ranks, no device
      std::cout << fsdp::train::projection_report(args);
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
  try {
    return fsdp::train::Trainer(args).train();
  } catch (const fsdp::train::UsageError& e) {
    // Found by the ranks together at start-up (another run holds the --save-dir or the log): the
    // rank that found it says it, every rank exits 2.
    if (*e.what()) std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fsdp::abort_job("fsdp-train: error on rank " + std::to_string(launch_rank()) + ": " + fsdp::error_text(e));
  }
  return 0;
}
