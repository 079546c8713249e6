// Memory figures for progress lines and logs.
#pragma once

#include <c10/core/Device.h>

namespace fsdp::train {

struct MemoryPeaks {
  double allocated_gib = 0;  // device: peak allocated since the last reset; cpu: peak RSS
  double reserved_gib = 0;   // device: peak reserved by the caching allocator; cpu: 0
};

// Reads the peaks since the last call and starts a new measurement window.
MemoryPeaks take_memory_peaks(const c10::Device& device);

}  // namespace fsdp::train
