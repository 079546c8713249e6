#include "train/metrics_bridge.h"

#include <sys/wait.h>

#include <cstdlib>
#include <stdexcept>

#include "train/args.h"

namespace fsdp::train {

const MetricsWriter kTensorboardWriter{"--tensorboard", "tensorboard", "torch.utils.tensorboard", "tensorboard",
                                       "TensorBoard in "};
const MetricsWriter kWandbWriter{"--wandb", "wandb", "wandb", "wandb", "W&B project "};

namespace {

// `text` as one word for /bin/sh.
std::string shell_quoted(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// "exec PYTHON ARGS" with the package importable: the python is $FSDP_PYTHON (the wheel's
// commands set it: that python has the installed package), else the build's with the build tree's
// package (build/py) on PYTHONPATH.
std::string python_command(const std::string& args) {
  const char* python = std::getenv("FSDP_PYTHON");
  if (python && *python) return "exec " + shell_quoted(python) + " " + args;
  return "PYTHONPATH=" + shell_quoted(FSDP_BUILD_PY_PACKAGE) + "${PYTHONPATH:+:$PYTHONPATH} exec " +
         shell_quoted(FSDP_BUILD_PYTHON) + " " + args;
}

}  // namespace

void check_metrics_writer(const MetricsWriter& writer) {
  const std::string command =
      python_command("-c 'import fsdpcpp." + std::string(writer.module) + ", " + writer.imports + "' 2>&1");
  if (std::system(command.c_str()) != 0)
    throw UsageError(std::string(writer.flag) + ": '" + command + "' failed (its message is above): pip install " +
                     writer.package + " into that python, or set FSDP_PYTHON to one that has it");
}

MetricsBridge::MetricsBridge(const MetricsWriter& writer, const std::string& target,
                             const std::vector<std::string>& options)
    : writer_(writer), target_(target) {
  std::string command_args = "-m fsdpcpp." + std::string(writer.module) + " " + shell_quoted(target);
  for (const std::string& option : options) command_args += " " + shell_quoted(option);
  const std::string command = python_command(command_args);
  pipe_ = ::popen(command.c_str(), "w");
  if (!pipe_) throw std::runtime_error(std::string(writer.flag) + ": cannot start '" + command + "'");
}

MetricsBridge::~MetricsBridge() { close(); }

void MetricsBridge::send(const std::string& json_line) {
  if (!pipe_ || failed_) return;
  if (std::fputs((json_line + "\n").c_str(), pipe_) < 0 || std::fflush(pipe_) != 0) failed_ = true;
}

std::string MetricsBridge::close() {
  if (!pipe_) return "";
  const int status = ::pclose(pipe_);
  pipe_ = nullptr;
  if (!failed_ && status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return std::string(writer_.flag) + ": its writer (python -m fsdpcpp." + writer_.module + ") failed (exit status " +
         std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) +
         "; its message is above); the JSONL log has every step";
}

}  // namespace fsdp::train
