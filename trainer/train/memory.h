// Memory figures for progress lines and logs.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace fsdp::train {

struct MemoryPeaks {
  double allocated_gib = 0;  // device: peak allocated since the last reset; cpu: peak RSS
  double reserved_gib = 0;   // device: peak reserved by the caching allocator; cpu: 0
  double active_gib = 0;     // device: peak of blocks in use or awaiting reuse on a stream
  long alloc_retries = 0;    // device: cudaMalloc failures the allocator recovered from by freeing its cache
  // At the moment of the call: the exact bytes allocated and reserved (device; 0 on CPU) and the
  // resident host memory, for checks that memory stays flat over a long run.
  int64_t allocated_now_bytes = 0, reserved_now_bytes = 0;
  double rss_now_gib = 0;
};

// Reads the peaks since the last call and starts a new measurement window.
MemoryPeaks take_memory_peaks(const c10::Device& device);
// Resident set size of this process, GiB.
double resident_gib();
// The most host memory this process has held (VmHWM), in GiB.
double peak_resident_gib();
// This machine's available host memory (MemAvailable), -1 if unknown.
double available_host_bytes();
// The memory of the smallest visible GPU, -1 without GPUs. Creates no CUDA context.
double smallest_gpu_bytes();
// Returns the caching allocator's unused blocks to the device (GPU only), so
// that measurements start from what the model really holds.
void release_cached_memory(const c10::Device& device);
// Makes cuBLAS allocate its workspaces now, one per thread that runs
// matrix products (this one for forward, autograd's for backward). They live as
// long as the process; allocated by the first step's first products instead,
// each pins a block amid that step's activations, and the pool's free memory
// stays split around it (seen in the 1B checkpointed run's allocator snapshot).
void allocate_library_workspaces(const c10::Device& device);
// GPU only: start recording allocator history, and write it as a snapshot
// that PyTorch's memory_viz page (pytorch.org/memory_viz) loads. Return false
// on CPU.
bool start_memory_history(const c10::Device& device);
// Throws if the file cannot be written completely.
bool write_memory_snapshot(const c10::Device& device, const std::string& path);
// Writes `bytes` to `path`; throws naming the path and the system's reason if any of it fails.
void write_file(const std::string& path, const std::string& bytes);

}  // namespace fsdp::train
