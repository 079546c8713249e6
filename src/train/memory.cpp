#include "train/memory.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>

#ifdef FSDP_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

namespace fsdp::train {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The "Key: N kB" figure of a /proc file (status, meminfo) in KiB; -1 if absent.
double proc_kib(const char* path, const std::string& key) {
  std::ifstream in(path);
  for (std::string word; in >> word;) {
    if (word == key) {
      double kib = -1;
      in >> kib;
      return kib;
    }
  }
  return -1;
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
    peaks.active_gib = stats.active_bytes[all].peak / kGiB;
    static long retries_before = 0;
    peaks.alloc_retries = stats.num_alloc_retries - retries_before;
    retries_before = stats.num_alloc_retries;
    alloc::resetPeakStats(device.index());
    return peaks;
  }
#endif
  peaks.allocated_gib = std::max(0.0, proc_kib("/proc/self/status", "VmHWM:")) * 1024.0 / kGiB;
  return peaks;
}

void require_host_memory(double bytes, const std::string& what) {
  const double available_kib = proc_kib("/proc/meminfo", "MemAvailable:");
  if (available_kib < 0) return;  // no figure to check against
  int local = 1;
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    if (const char* v = std::getenv(name)) {
      local = std::max(1, std::atoi(v));
      break;
    }
  const double available = available_kib * 1024.0, needed = bytes * local;
  if (needed <= available) return;
  char message[512];
  std::snprintf(message, sizeof(message),
                "%s take %.1f GB of host memory in each of the %d process(es) on this machine, %.1f GB "
                "in all, but %.1f GB is available: use a smaller model or fewer processes per machine",
                what.c_str(), bytes / 1e9, local, needed / 1e9, available / 1e9);
  throw std::runtime_error(message);
}

void release_cached_memory(const c10::Device& device) {
#ifdef FSDP_WITH_NCCL
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

void allocate_library_workspaces(const c10::Device& device) {
  // Runs on CPU too (two 64x64 products, nothing kept), so CI executes the same code.
  // bf16, the model's compute dtype, so that the products take the same library path.
  // (at:: factories ignore requires_grad in their options: set it on the tensor.)
  auto x = at::ones({64, 64}, at::TensorOptions(device).dtype(at::kBFloat16)).requires_grad_(true);
  at::matmul(x, x).sum().backward();  // forward on this thread, backward on autograd's
}

bool start_memory_history(const c10::Device& device) {
#ifdef FSDP_WITH_NCCL
  if (device.is_cuda()) {
    torch::cuda::_record_memory_history(std::string("all"), std::string("all"), "python", 100000);
    return true;
  }
#endif
  return false;
}

bool write_memory_snapshot(const c10::Device& device, const std::string& path) {
#ifdef FSDP_WITH_NCCL
  if (device.is_cuda()) {
    const std::string pickled = torch::cuda::_memory_snapshot_pickled();
    std::ofstream(path, std::ios::binary).write(pickled.data(), static_cast<std::streamsize>(pickled.size()));
    return true;
  }
#endif
  return false;
}

}  // namespace fsdp::train
