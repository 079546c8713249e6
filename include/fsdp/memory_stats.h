// Bytes allocated on a device, as its allocator counts them: the CUDA caching allocator's
// "allocated" statistics on GPUs; on CPU a counting wrapper around c10's CPU allocator, installed
// on request (count_host_allocations), since c10 keeps no such count for host memory. The
// planner's profile reads these (fsdp/planning.h): on CPU ranks, count host allocations before
// the model is made.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace fsdp {

/// What an allocator counts, in bytes.
struct AllocatedBytes {
  int64_t now = 0;   ///< allocated now
  int64_t peak = 0;  ///< the most since the last reset_peak_allocated
};

/// From now on, tensors allocated on the host are counted (those made before are not). Keeps c10's
/// contract for CPU allocators (oneDNN and every raw_allocate caller work as before); lasts for the
/// process. Idempotent.
void count_host_allocations();
/// Whether count_host_allocations() was called.
bool counting_host_allocations();

/// The device's allocated bytes; on CPU zeros unless count_host_allocations() was called.
AllocatedBytes allocated_bytes(const c10::Device& device);
/// Restarts the device's peak at what is allocated now.
void reset_peak_allocated(const c10::Device& device);

}  // namespace fsdp
