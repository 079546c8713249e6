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
};

// Reads the peaks since the last call and starts a new measurement window.
MemoryPeaks take_memory_peaks(const c10::Device& device);
// Throws when this machine's available memory cannot hold `bytes` in each of the
// processes started on it (LOCAL_WORLD_SIZE, or Open MPI's local size), naming
// `what` and the figures: refusing up front beats being killed by the kernel
// half-way through building a model.
void require_host_memory(double bytes, const std::string& what);
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
bool write_memory_snapshot(const c10::Device& device, const std::string& path);

}  // namespace fsdp::train
