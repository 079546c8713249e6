// The parameter groups' own device buffers in a memory pool of their own.
//
// A group allocates its unsharded parameters, its all-gather and reduce-scatter buffers and the
// sharded gradients these become once per pass, in the same sizes every step, while the model
// allocates the activations autograd saves around them. In the CUDA caching allocator's common
// pool each buffer freed between saved activations left a hole that later, smaller tensors split,
// and the pool grew past it: the 3B in bf16 on one H200 reserved 54.8 GiB for a peak of 49.5 GiB
// allocated (bench/results/2026-11-26-h200-1d9f0b0/). In a pool of their own the buffers come
// back in the same sizes every step, and the activations pack.
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
