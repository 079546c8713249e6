// Metrics where users look, written by the libraries that own the formats: rank 0's step lines
// go, as they are logged, to a Python writer fed on its stdin. fsdp-train --tensorboard DIR runs
// `python -m fsdpcpp.tensorboard DIR` (python/fsdpcpp/tensorboard.py, TensorBoard's own writer);
// --wandb PROJECT runs `python -m fsdpcpp.wandb PROJECT` (python/fsdpcpp/wandb.py, wandb itself).
// The python is $FSDP_PYTHON, else the one this build was configured with.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace fsdp::train {

// One kind of writer: the flag that asks for it, its module in fsdpcpp and what it imports.
struct MetricsWriter {
  const char* flag;     // "--tensorboard"
  const char* module;   // python -m fsdpcpp.<module>
  const char* imports;  // the library it writes with ("torch.utils.tensorboard")
  const char* package;  // what to pip install for it ("tensorboard")
  const char* where;    // how the run's last line names where it wrote ("TensorBoard in ")
};
extern const MetricsWriter kTensorboardWriter, kWandbWriter;

// Throws UsageError when the writer's python cannot import it (checked before the run starts, so
// that no run learns it at its end).
void check_metrics_writer(const MetricsWriter& writer);

class MetricsBridge {
 public:
  // Starts `python -m fsdpcpp.<module> TARGET OPTIONS...`, TARGET what it writes to (a directory,
  // a project); throws std::runtime_error naming the command if it cannot.
  MetricsBridge(const MetricsWriter& writer, const std::string& target, const std::vector<std::string>& options = {});
  ~MetricsBridge();
  MetricsBridge(const MetricsBridge&) = delete;
  MetricsBridge& operator=(const MetricsBridge&) = delete;
  // One step's JSON line. A writer that has died is reported once (close() says why), never fatal.
  void send(const std::string& json_line);
  // Ends the input and waits for the writer: its files are complete. "" when it succeeded, else
  // what went wrong.
  std::string close();
  // How the run's last line names what it wrote to: "TensorBoard in DIR".
  std::string wrote() const { return writer_.where + target_; }

 private:
  const MetricsWriter& writer_;
  std::string target_;
  FILE* pipe_ = nullptr;
  bool failed_ = false;
};

}  // namespace fsdp::train
