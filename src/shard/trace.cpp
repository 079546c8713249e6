#include "shard/trace.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <fstream>
#include <stdexcept>

namespace fsdp {

Trace& Trace::get() {
  static Trace trace;
  return trace;
}

void Trace::start(const at::Device& device) {
  device_ = device;
  spans_.clear();
  origin_time_ = std::chrono::steady_clock::now();
  origin_ = nullptr;
  if (device.is_cuda())
    origin_ = timed_event(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  active_ = true;
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

int Trace::begin(std::string name, Track track, const std::optional<c10::Stream>& stream) {
  if (!active_) return -1;
  spans_.push_back(Span{std::move(name), track, timed_event(stream), nullptr, now_us(), 0});
  return static_cast<int>(spans_.size()) - 1;
}

void Trace::end(int token, const std::optional<c10::Stream>& stream) {
  if (!active_ || token < 0 || token >= static_cast<int>(spans_.size())) return;
  spans_[token].end_event = timed_event(stream);
  spans_[token].end_us = now_us();
}

void Trace::write(const std::string& path, int rank) {
  if (!active_) return;
  active_ = false;
  std::ofstream out(path);
  if (!out) throw std::invalid_argument("fsdp: cannot write the trace file '" + path + "'");
  static const char* track_names[] = {"compute", "all-gather", "reduce-scatter"};
  out << "{\"traceEvents\":[";
  for (int t = 0; t < 3; ++t)
    out << (t ? "," : "") << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << rank
        << ",\"tid\":" << t << ",\"args\":{\"name\":\"" << track_names[t] << "\"}}";
  for (auto& span : spans_) {
    if (span.start_event && span.end_event && origin_) {
      span.end_event->synchronize();
      span.start_us = origin_->elapsedTime(*span.start_event) * 1000.0;
      span.end_us = origin_->elapsedTime(*span.end_event) * 1000.0;
    }
    if (span.end_us < span.start_us) continue;  // never ended
    out << ",{\"ph\":\"X\",\"name\":\"" << span.name << "\",\"pid\":" << rank
        << ",\"tid\":" << static_cast<int>(span.track) << ",\"ts\":" << span.start_us
        << ",\"dur\":" << span.end_us - span.start_us << "}";
  }
  out << "]}\n";
  spans_.clear();
  out.close();
  if (!out) throw std::runtime_error("fsdp: could not write the whole trace file '" + path + "'");
}

}  // namespace fsdp
