// Chrome-trace recording of compute, all-gather and reduce-scatter spans,
// one track per stream, so overlap can be seen in Perfetto or
// chrome://tracing. On GPUs spans are timed with CUDA events on the stream
// the work runs on; on CPU with the wall clock. Off unless started.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

class Trace {
 public:
  enum class Track { Compute = 0, AllGather = 1, ReduceScatter = 2 };
  static Trace& get();

  void start(const at::Device& device);
  bool active() const { return active_; }
  // A span on `track`, begun now on `stream` (ignored on CPU). Returns a
  // token for end(); -1 when tracing is off.
  int begin(std::string name, Track track, const std::optional<c10::Stream>& stream = {});
  void end(int token, const std::optional<c10::Stream>& stream = {});
  // Waits for the device, writes {"traceEvents": [...]} with this rank as
  // the process, and stops.
  void write(const std::string& path, int rank);

 private:
  struct Span {
    std::string name;
    Track track;
    std::shared_ptr<c10::Event> start_event, end_event;
    double start_us = 0, end_us = 0;  // CPU clock, or filled from the events
  };
  std::shared_ptr<c10::Event> timed_event(const std::optional<c10::Stream>& stream) const;
  double now_us() const;

  bool active_ = false;
  at::Device device_ = at::kCPU;
  std::shared_ptr<c10::Event> origin_;
  std::chrono::steady_clock::time_point origin_time_;
  std::vector<Span> spans_;
};

}  // namespace fsdp
