#include "train/memory.h"

#include <fstream>
#include <string>

#ifdef FSDP_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace fsdp::train {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double peak_rss_gib() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      double kib = 0;
      status >> kib;
      return kib * 1024.0 / kGiB;
    }
  }
  return 0;
}

}  // namespace

MemoryPeaks take_memory_peaks(const c10::Device& device) {
  MemoryPeaks peaks;
#ifdef FSDP_WITH_NCCL
  if (device.is_cuda()) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const auto stats = alloc::getDeviceStats(device.index());
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    peaks.allocated_gib = stats.allocated_bytes[all].peak / kGiB;
    peaks.reserved_gib = stats.reserved_bytes[all].peak / kGiB;
    alloc::resetPeakStats(device.index());
    return peaks;
  }
#endif
  peaks.allocated_gib = peak_rss_gib();
  return peaks;
}

}  // namespace fsdp::train
