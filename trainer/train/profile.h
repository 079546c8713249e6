// The PyTorch profiler (kineto) from C++: CPU operators and, on GPUs, every
// kernel and copy with the stream it ran on, saved as a Chrome trace that
// Perfetto opens and bench/profile_summary.py reads.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace fsdp::train {

void start_profile(const c10::Device& device);
// Stops the profiler started above and writes its trace to `path`.
void save_profile(const std::string& path);

}  // namespace fsdp::train
