#include "shard/buffer_pool.h"

#ifdef FSDP_WITH_NCCL  // torch built with CUDA
#include <ATen/cuda/MemPool.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <thread>
#endif

namespace fsdp {

#ifdef FSDP_WITH_NCCL
namespace {

struct DevicePool {
  std::recursive_mutex recording;  // held by the thread recording into the pool
  int depth = 0;                   // that thread's nested scopes
  at::cuda::MemPool* pool = nullptr;
};

DevicePool& device_pool(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, DevicePool> pools;
  std::lock_guard<std::mutex> lock(mutex);
  DevicePool& slot = pools[device];
  if (!slot.pool) {
    const c10::cuda::CUDAGuard guard(device);  // MemPool takes the current device
    // Never destroyed: its memory is the groups' for the whole process, and a static destructor
    // would run after the CUDA runtime has gone.
    slot.pool = new at::cuda::MemPool();
  }
  return slot;
}

}  // namespace
#endif

GroupBufferScope::GroupBufferScope(const c10::Device& device) {
#ifdef FSDP_WITH_NCCL
  if (!device.is_cuda()) return;
  device_ = device.has_index() ? device.index() : c10::cuda::current_device();
  DevicePool& p = device_pool(static_cast<c10::DeviceIndex>(device_));
  p.recording.lock();
  if (p.depth++ > 0) return;
  const auto thread = std::this_thread::get_id();
  c10::cuda::CUDACachingAllocator::beginAllocateToPool(
      static_cast<c10::DeviceIndex>(device_), p.pool->id(),
      [thread](cudaStream_t) { return std::this_thread::get_id() == thread; });
#endif
}

GroupBufferScope::~GroupBufferScope() {
#ifdef FSDP_WITH_NCCL
  if (device_ < 0) return;
  const auto index = static_cast<c10::DeviceIndex>(device_);
  DevicePool& p = device_pool(index);
  if (--p.depth == 0) {
    // The allocator defers its own bookkeeping while any pool records, so each scope is short.
    c10::cuda::CUDACachingAllocator::endAllocateToPool(index, p.pool->id());
    c10::cuda::CUDACachingAllocator::releasePool(index, p.pool->id());  // the count begin added
  }
  p.recording.unlock();
#endif
}

}  // namespace fsdp
