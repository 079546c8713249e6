#include "shard/trace.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdio>
#include <iterator>
#include <stdexcept>

#include "fsdp/memory_stats.h"
#include "io/files.h"

namespace fsdp {
namespace {

// Tracks of host work, timed with the host's clock and taking no memory marks.
bool on_host(Trace::Track track) { return track == Trace::Track::HostStep || track == Trace::Track::HostWait; }

}  // namespace

Trace& Trace::get() {
  static Trace trace;
  return trace;
}

void Trace::start(const at::Device& device, bool with_memory) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_ = device;
  with_memory_ = with_memory;
  spans_.clear();
  marks_.clear();
  origin_ = nullptr;
  if (device.is_cuda()) {
    // The device's and the host's clocks start together: on an idle stream the origin event
    // runs as it is recorded (the host track's issue times are compared with device times).
    const c10::impl::VirtualGuardImpl guard(device.type());
    guard.synchronizeDevice(device.index());
    origin_ = timed_event(guard.getStream(device));
  }
  origin_time_ = std::chrono::steady_clock::now();
  active_ = true;
  add_mark();
}

std::shared_ptr<c10::Event> Trace::timed_event(const std::optional<c10::Stream>& stream) const {
  if (!device_.is_cuda() || !stream) return nullptr;
  auto event = std::make_shared<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  event->record(*stream);
  return event;
}

double Trace::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_time_)
      .count();
}

int Trace::add_mark() {
  if (!with_memory_) return -1;
  const AllocatedBytes bytes = allocated_bytes(device_);
  marks_.push_back({bytes.now, marks_.empty() ? bytes.now : bytes.peak});
  reset_peak_allocated(device_);
  return static_cast<int>(marks_.size()) - 1;
}

void Trace::mark() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (active_) add_mark();
}

int Trace::begin(std::string name, Track track, const std::optional<c10::Stream>& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!active_) return -1;
  const int start_mark = on_host(track) ? -1 : add_mark();
  spans_.push_back(Span{std::move(name), track, timed_event(stream), nullptr, now_us(), -1, start_mark, -1});
  return static_cast<int>(spans_.size()) - 1;
}

void Trace::end(int token, const std::optional<c10::Stream>& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!active_ || token < 0 || token >= static_cast<int>(spans_.size())) return;
  Span& span = spans_[token];
  span.end_mark = on_host(span.track) ? -1 : add_mark();
  span.end_event = timed_event(stream);
  span.end_us = now_us();
}

Trace::Recording Trace::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  Recording recording;
  if (!active_) return recording;
  active_ = false;
  for (const auto& span : spans_) {
    if (span.end_us < 0) continue;  // never ended
    FinishedSpan f{span.name, span.track, span.start_us / 1000, span.end_us / 1000, span.start_us / 1000,
                   span.end_us / 1000, span.start_mark, span.end_mark};
    if (span.start_event && span.end_event && origin_) {
      span.end_event->synchronize();
      f.start_ms = origin_->elapsedTime(*span.start_event);
      f.end_ms = origin_->elapsedTime(*span.end_event);
    }
    recording.spans.push_back(std::move(f));
  }
  recording.marks = std::move(marks_);
  spans_.clear();
  marks_.clear();
  // No event outlives the recording: a static Trace holding one past the end of the process
  // would destroy it after CUDA is torn down (a crash at exit in Python).
  origin_ = nullptr;
  return recording;
}

void Trace::write(const std::string& path, int rank) {
  if (!active()) return;
  const auto spans = finish().spans;
  // Built as a string and written through io/files.h (no iostreams: see comm/communicator.cpp).
  static const char* const track_names[] = {"compute", "all-gather", "reduce-scatter", "all-reduce", "host step", "host"};
  static_assert(std::size(track_names) == static_cast<size_t>(Track::HostWait) + 1, "a name for every track");
  const std::string pid = std::to_string(rank), host = std::to_string(static_cast<int>(Track::HostWait));
  std::string json = "{\"traceEvents\":[";
  for (int t = 0; t < static_cast<int>(std::size(track_names)); ++t)
    json += std::string(t ? "," : "") + "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" + pid +
            ",\"tid\":" + std::to_string(t) + ",\"args\":{\"name\":\"" + track_names[t] + "\"}}";
  char times[128];
  for (const auto& span : spans) {
    // Each span with the time the host issued it; a device span's issue is also an instant on the
    // host track, where the host's waits are spans.
    std::snprintf(times, sizeof(times), ",\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"issued_us\":%.3f}}",
                  span.start_ms * 1000, (span.end_ms - span.start_ms) * 1000, span.host_start_ms * 1000);
    json += ",{\"ph\":\"X\",\"name\":\"" + span.name + "\",\"pid\":" + pid +
            ",\"tid\":" + std::to_string(static_cast<int>(span.track)) + times;
    if (on_host(span.track)) continue;
    std::snprintf(times, sizeof(times), ",\"ts\":%.3f}", span.host_start_ms * 1000);
    json += ",{\"ph\":\"i\",\"s\":\"t\",\"name\":\"issue " + span.name + "\",\"pid\":" + pid + ",\"tid\":" + host +
            times;
  }
  json += "]}\n";
  io::OutputFile out(path);  // throws naming the path and the system's reason
  out.write(json.data(), json.size());
  out.close();
}

}  // namespace fsdp
