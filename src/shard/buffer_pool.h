// The parameter groups' all-gather buffers (the unsharded parameters) in a memory pool of their own.
//
// A group allocates its unsharded parameters before each forward and backward and frees them after,
// in the same sizes every step, while the model allocates the activations autograd saves around
// them. In the CUDA caching allocator's common pool each buffer freed between saved activations
// left a hole that later, smaller tensors split, and the pool grew past it. In a pool of their own
// the buffers come back in the same sizes every step. Only these: the sharded gradients in the
// pool as well (measured, bench/results/2026-11-26-h200-79381d3/) raised the reserved memory by
// 3.6-5.4 GiB, since two pools peak apart (activations at backward's start, gradients at its end)
// where one pool reuses the activations' memory for the gradients.
#pragma once

#include <c10/core/Device.h>

namespace fsdp {

// While alive, this thread's allocations on `device` come from the groups' pool (one per CUDA
// device, kept for the process). Scopes on one thread nest; other threads wait for the outermost
// to end (the allocator records into one pool for one caller at a time). No-op on other devices.
// Keep the scope to the buffers' own allocations: a temporary allocated inside it would leave
// its hole in the pool instead.
class GroupBufferScope {
 public:
  explicit GroupBufferScope(const c10::Device& device);
  ~GroupBufferScope();
  GroupBufferScope(const GroupBufferScope&) = delete;
  GroupBufferScope& operator=(const GroupBufferScope&) = delete;

 private:
  int device_ = -1;  // the CUDA device recording into the pool, -1 where this scope does nothing
};

}  // namespace fsdp
