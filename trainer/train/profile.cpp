#include "train/profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <sys/stat.h>

#include <set>
#include <stdexcept>

namespace fsdp::train {

namespace {
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;
}  // namespace

void start_profile(const c10::Device& device) {
  std::set<ActivityType> activities{ActivityType::CPU};
  if (device.is_cuda()) activities.insert(ActivityType::CUDA);
  const ProfilerConfig config(ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
}

void save_profile(const std::string& path) {
  torch::autograd::profiler::disableProfiler()->save(path);
  // save() reports a failed write only in a log line: check that the file is there.
  struct stat st{};
  if (stat(path.c_str(), &st) != 0 || st.st_size == 0)
    throw std::runtime_error("could not write the profile '" + path + "'");
}

}  // namespace fsdp::train
