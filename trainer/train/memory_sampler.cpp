#include "train/memory_sampler.h"

#include "train/memory.h"

#include <stdexcept>

#ifdef FSDP_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace fsdp::train {

MemorySampler::MemorySampler(const c10::Device& device, const std::string& path,
                             std::chrono::milliseconds period)
    : device_(device), path_(path), out_(path), period_(period), start_(std::chrono::steady_clock::now()) {
  if (!out_) throw std::invalid_argument("cannot write the memory log '" + path + "'");
  thread_ = std::thread([this] { loop(); });
}

MemorySampler::~MemorySampler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void MemorySampler::close() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  out_.close();
  if (!out_) throw std::runtime_error("cannot write the memory log '" + path_ + "'");
}

double MemorySampler::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void MemorySampler::loop() {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  while (!stop_) {
    double allocated = 0, reserved = 0;
#ifdef FSDP_WITH_NCCL
    if (device_.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
      const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      allocated = stats.allocated_bytes[all].current / kGiB;
      reserved = stats.reserved_bytes[all].current / kGiB;
    }
#endif
    {
      std::lock_guard<std::mutex> lock(mutex_);
      out_ << "{\"t\":" << seconds() << ",\"alloc_gib\":" << allocated
           << ",\"reserved_gib\":" << reserved << ",\"rss_gib\":" << resident_gib() << "}\n";
    }
    std::this_thread::sleep_for(period_);
  }
}

void MemorySampler::mark_step(int step, double loss) {
  std::lock_guard<std::mutex> lock(mutex_);
  out_ << "{\"t\":" << seconds() << ",\"step\":" << step << ",\"loss\":" << loss << "}\n";
  out_.flush();
}

}  // namespace fsdp::train
