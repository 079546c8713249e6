// The four streams of one device and events between them, through c10's
// device-generic stream API (no CUDA headers here). On CPU there are no
// streams: every operation completes before it returns and all of this is
// inert.
//
// The rules that make buffers safe to free without record_stream (details in
// src/shard/README.md): every operation issued on the all-gather or reduce-scatter
// stream first waits for the compute stream's position at the time of issue,
// so it may use memory just allocated from the compute stream's pool; and a
// buffer a side stream used is dropped only once the compute stream has
// waited for that use, so compute-stream work that gets the memory next runs
// after it. All buffers come from the compute stream's pool.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <optional>
#include <vector>

namespace fsdp {

class DeviceStreams {
 public:
  // The streams of `device` (created once per device and shared).
  static const DeviceStreams& of(const at::Device& device);

  bool active() const { return all_gather_.has_value(); }
  // Where the caller's kernels go: the current stream.
  c10::Stream compute() const;
  const c10::Stream& all_gather() const { return *all_gather_; }
  const c10::Stream& reduce_scatter() const { return *reduce_scatter_; }
  const c10::Stream& all_reduce() const { return *all_reduce_; }  // HSDP's replicas

  std::shared_ptr<c10::Event> record(const c10::Stream& stream) const;
  // `waiter` runs nothing more until `event` (or all work so far on `from`).
  void wait(const c10::Stream& waiter, const c10::Event& event) const;
  void wait(const c10::Stream& waiter, const c10::Stream& from) const;

 private:
  explicit DeviceStreams(const at::Device& device);
  at::Device device_;
  std::optional<c10::Stream> all_gather_, reduce_scatter_, all_reduce_;
};

// Work issued on a stream, with the buffers it uses kept alive until it is
// done. An item of an InflightQueue.
struct DeviceWork {
  std::shared_ptr<c10::Event> event;  // null: already complete (CPU)
  std::vector<at::Tensor> keep_alive;
  bool done() const { return !event || event->query(); }
  void wait() const {
    if (event) event->synchronize();
  }
};

}  // namespace fsdp
