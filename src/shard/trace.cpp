#include "shard/trace.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <fstream>
#include <stdexcept>

#include "fsdp/memory_stats.h"

namespace fsdp {

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
  origin_time_ = std::chrono::steady_clock::now();
  origin_ = nullptr;
  if (device.is_cuda())
    origin_ = timed_event(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
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
  const int start_mark = track == Track::HostStep ? -1 : add_mark();
  spans_.push_back(Span{std::move(name), track, timed_event(stream), nullptr, now_us(), -1, start_mark, -1});
  return static_cast<int>(spans_.size()) - 1;
}

void Trace::end(int token, const std::optional<c10::Stream>& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!active_ || token < 0 || token >= static_cast<int>(spans_.size())) return;
  Span& span = spans_[token];
  span.end_mark = span.track == Track::HostStep ? -1 : add_mark();
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
  std::ofstream out(path);
  if (!out) throw std::invalid_argument("fsdp: cannot write the trace file '" + path + "'");
  static const char* track_names[] = {"compute", "all-gather", "reduce-scatter", "all-reduce", "host step"};
  out << "{\"traceEvents\":[";
  for (int t = 0; t < 5; ++t)
    out << (t ? "," : "") << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << rank
        << ",\"tid\":" << t << ",\"args\":{\"name\":\"" << track_names[t] << "\"}}";
  for (const auto& span : spans) {
    out << ",{\"ph\":\"X\",\"name\":\"" << span.name << "\",\"pid\":" << rank
        << ",\"tid\":" << static_cast<int>(span.track) << ",\"ts\":" << span.start_ms * 1000
        << ",\"dur\":" << (span.end_ms - span.start_ms) * 1000 << "}";
  }
  out << "]}\n";
  out.close();
  if (!out) throw std::runtime_error("fsdp: could not write the whole trace file '" + path + "'");
}

}  // namespace fsdp
