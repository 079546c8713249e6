// Chrome-trace recording of compute, all-gather, reduce-scatter and all-reduce spans,
// one track per stream, so overlap can be seen in Perfetto or
// chrome://tracing. On GPUs spans are timed with CUDA events on the stream
// the work runs on; on CPU with the wall clock. The host-step track holds the
// optimizer steps in backward, timed with the host's clock (they may run on
// the root's host worker: spans may begin and end on any thread). The host-wait
// track holds the CPU's waits on the in-flight caps, on the host's clock; with
// the time the CPU issued each device span (its args' issued_us, and an
// instant on the host track), a trace shows how far ahead of the GPU the CPU
// ran (bench/trace_overlap.py). Off unless started.
//
// Started with memory, it also keeps memory marks: at every span's start and
// end, and where the runtime calls mark() (before an all-gather allocates,
// after a reshard frees), the bytes allocated then and the most allocated
// since the previous mark (shard/memory_stats.h). The planner's cost model is
// measured from them (plan/measured_step.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

class Trace {
 public:
  enum class Track { Compute = 0, AllGather = 1, ReduceScatter = 2, AllReduce = 3, HostStep = 4, HostWait = 5 };
  static Trace& get();

  struct MemoryMark {
    int64_t allocated = 0;        // bytes allocated at the mark
    int64_t peak_since_last = 0;  // the most allocated since the previous mark
  };
  struct FinishedSpan {
    std::string name;
    Track track;
    double start_ms = 0, end_ms = 0;            // device time (the wall clock on CPU)
    double host_start_ms = 0, host_end_ms = 0;  // when the host issued its start and end
    int start_mark = -1, end_mark = -1;         // indices into Recording::marks (with memory)
  };
  struct Recording {
    std::vector<FinishedSpan> spans;  // those that ended, in the order begun
    std::vector<MemoryMark> marks;    // empty without memory
  };

  void start(const at::Device& device, bool with_memory = false);
  bool active() const { return active_; }
  // A span on `track`, begun now on `stream` (ignored on CPU). Returns a
  // token for end(); -1 when tracing is off. Host-step and host-wait spans take
  // no memory marks (the marks follow the device's work in the order it is issued).
  int begin(std::string name, Track track, const std::optional<c10::Stream>& stream = {});
  void end(int token, const std::optional<c10::Stream>& stream = {});
  // A memory mark (when recording memory).
  void mark();
  // Waits for the device, writes {"traceEvents": [...]} with this rank as
  // the process, and stops.
  void write(const std::string& path, int rank);
  // Waits for the device and stops.
  Recording finish();

 private:
  struct Span {
    std::string name;
    Track track;
    std::shared_ptr<c10::Event> start_event, end_event;
    double start_us = 0, end_us = -1;  // CPU clock
    int start_mark = -1, end_mark = -1;
  };
  std::shared_ptr<c10::Event> timed_event(const std::optional<c10::Stream>& stream) const;
  double now_us() const;
  int add_mark();  // its index, -1 without memory

  std::mutex mutex_;  // for all below
  std::atomic<bool> active_{false};
  bool with_memory_ = false;
  at::Device device_ = at::kCPU;
  std::shared_ptr<c10::Event> origin_;
  std::chrono::steady_clock::time_point origin_time_;
  std::vector<Span> spans_;
  std::vector<MemoryMark> marks_;
};

}  // namespace fsdp
