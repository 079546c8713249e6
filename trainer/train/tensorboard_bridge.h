// fsdp-train --tensorboard DIR: the step lines go, as they are logged, to `python -m
// fsdpcpp.tensorboard DIR` (python/fsdpcpp/tensorboard.py), which writes them with TensorBoard's own
// writer. The python is $FSDP_PYTHON, else the one this build was configured with.
#pragma once

#include <cstdio>
#include <string>

namespace fsdp::train {

// Throws UsageError when the writer's python cannot import TensorBoard's writer (checked before
// the run starts, so that no run learns it at its end).
void check_tensorboard_writer();

class TensorboardBridge {
 public:
  // Starts the writer; throws std::runtime_error naming the command if it cannot.
  explicit TensorboardBridge(const std::string& dir);
  ~TensorboardBridge();
  TensorboardBridge(const TensorboardBridge&) = delete;
  TensorboardBridge& operator=(const TensorboardBridge&) = delete;
  // One step's JSON line. A writer that has died is reported once (close() says why), never fatal.
  void send(const std::string& json_line);
  // Ends the input and waits for the writer: its event file is complete. "" when it succeeded,
  // else what went wrong.
  std::string close();

 private:
  std::string dir_;
  FILE* pipe_ = nullptr;
  bool failed_ = false;
};

}  // namespace fsdp::train
