#include "train/tensorboard_bridge.h"

#include <sys/wait.h>

#include <cstdlib>
#include <stdexcept>

#include "train/args.h"

namespace fsdp::train {

namespace {

// `text` as one word for /bin/sh.
std::string shell_quoted(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// "exec PYTHON ARGS" with the package importable: the python is $FSDP_PYTHON (the wheel's
// commands set it), else the build's; a build tree's package (build/py) goes on PYTHONPATH.
std::string python_command(const std::string& args) {
  const char* python = std::getenv("FSDP_PYTHON");
  std::string command;
#ifdef FSDP_BUILD_PY_PACKAGE
  command += "PYTHONPATH=" + shell_quoted(FSDP_BUILD_PY_PACKAGE) + "${PYTHONPATH:+:$PYTHONPATH} ";
#endif
  return command + "exec " + shell_quoted(python && *python ? python : FSDP_BUILD_PYTHON) + " " + args;
}

}  // namespace

void check_tensorboard_writer() {
  const std::string command = python_command("-c 'import fsdpcpp.tensorboard, torch.utils.tensorboard' 2>&1");
  if (std::system(command.c_str()) != 0)
    throw UsageError("--tensorboard: '" + command + "' failed (its message is above): pip install tensorboard "
                     "into that python, or set FSDP_PYTHON to one that has it");
}

TensorboardBridge::TensorboardBridge(const std::string& dir) : dir_(dir) {
  const std::string command = python_command("-m fsdpcpp.tensorboard " + shell_quoted(dir));
  pipe_ = ::popen(command.c_str(), "w");
  if (!pipe_) throw std::runtime_error("--tensorboard: cannot start '" + command + "'");
}

TensorboardBridge::~TensorboardBridge() { close(); }

void TensorboardBridge::send(const std::string& json_line) {
  if (!pipe_ || failed_) return;
  if (std::fputs((json_line + "\n").c_str(), pipe_) < 0 || std::fflush(pipe_) != 0) failed_ = true;
}

std::string TensorboardBridge::close() {
  if (!pipe_) return "";
  const int status = ::pclose(pipe_);
  pipe_ = nullptr;
  if (!failed_ && status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return "--tensorboard: the writer of " + dir_ + " failed (exit status " +
         std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) +
         "; its message is above); the JSONL log has every step";
}

}  // namespace fsdp::train
