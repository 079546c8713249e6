// Samples memory in the background (every ~10 ms) into a JSONL file:
//   {"t": seconds, "alloc_gib": .., "reserved_gib": .., "rss_gib": ..}   (device figures 0 on CPU)
// and, from the training loop, one marker line per step:
//   {"t": .., "step": N, "loss": ..}
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

namespace fsdp::train {

class MemorySampler {
 public:
  MemorySampler(const c10::Device& device, const std::string& path,
                std::chrono::milliseconds period = std::chrono::milliseconds(10));
  ~MemorySampler();
  MemorySampler(const MemorySampler&) = delete;
  MemorySampler& operator=(const MemorySampler&) = delete;

  void mark_step(int step, double loss);
  // Stops sampling and throws if any line could not be written (the destructor only stops).
  void close();

 private:
  void loop();
  double seconds() const;

  c10::Device device_;
  std::string path_;
  std::ofstream out_;
  std::mutex mutex_;  // guards out_
  std::chrono::milliseconds period_;
  std::chrono::steady_clock::time_point start_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace fsdp::train
