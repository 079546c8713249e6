#include "train/memory.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>

#ifdef FSDP_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
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

double resident_gib() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return static_cast<double>(pages_resident) * sysconf(_SC_PAGESIZE) / kGiB;
}

double peak_resident_gib() {
  std::ifstream status("/proc/self/status");
  std::string key;
  double kib = 0;
  while (status >> key) {
    if (key == "VmHWM:") {
      status >> kib;
      break;
    }
  }
  return kib * 1024.0 / kGiB;
}

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
    peaks.allocated_now_bytes = stats.allocated_bytes[all].current;
    peaks.reserved_now_bytes = stats.reserved_bytes[all].current;
    peaks.rss_now_gib = resident_gib();
    retries_before = stats.num_alloc_retries;
    alloc::resetPeakStats(device.index());
    return peaks;
  }
#endif
  peaks.allocated_gib = std::max(0.0, proc_kib("/proc/self/status", "VmHWM:")) * 1024.0 / kGiB;
  peaks.rss_now_gib = resident_gib();
  return peaks;
}

double available_host_bytes() {
  const double kib = proc_kib("/proc/meminfo", "MemAvailable:");
  return kib < 0 ? -1 : kib * 1024.0;
}

double smallest_gpu_bytes() {
  double smallest = -1;
#ifdef FSDP_WITH_NCCL
  for (int i = 0; i < c10::cuda::device_count(); ++i) {
    cudaDeviceProp props{};
    if (cudaGetDeviceProperties(&props, i) != cudaSuccess) return -1;
    const double bytes = static_cast<double>(props.totalGlobalMem);
    smallest = smallest < 0 ? bytes : std::min(smallest, bytes);
  }
#endif
  return smallest;
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
    write_file(path, torch::cuda::_memory_snapshot_pickled());
    return true;
  }
#endif
  return false;
}

void write_file(const std::string& path, const std::string& bytes) {
  errno = 0;
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out)
    throw std::runtime_error("cannot write '" + path + "'" + (errno ? std::string(": ") + std::strerror(errno) : ""));
}

}  // namespace fsdp::train
