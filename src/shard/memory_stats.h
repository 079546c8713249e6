// Bytes allocated on a device, as its allocator counts them: the CUDA caching allocator's
// "allocated" statistics on GPUs; on CPU a counting wrapper around c10's CPU allocator, installed
// on request (count_host_allocations), since c10 keeps no such count for host memory.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace fsdp {

struct AllocatedBytes {
  int64_t now = 0;
  int64_t peak = 0;  // the most since the last reset_peak_allocated
};

// From now on, tensors allocated on the host are counted (those made before are not). Idempotent.
void count_host_allocations();
bool counting_host_allocations();

// On CPU zeros unless count_host_allocations() was called.
AllocatedBytes allocated_bytes(const c10::Device& device);
void reset_peak_allocated(const c10::Device& device);

}  // namespace fsdp
