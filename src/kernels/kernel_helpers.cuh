// What fsdp.cpp's CUDA kernels share (the library's float8 casts and the trainer's fused kernels): loads and stores in float32 arithmetic, 16-byte packs,
// launch checks and dtype dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/dtype.h"

namespace fsdp::kernels {

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

inline constexpr int kThreads = 256;

// V consecutive elements moved as one access (16 bytes for V = kVector<T>): one element at a time
// keeps too few bytes in flight per thread to approach the memory bandwidth.
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <class T>
inline constexpr int kVector = 16 / sizeof(T);

template <int V, class T>
__device__ __forceinline__ Pack<float, V> load_pack(const T* p) {
  const Pack<T, V> raw = *reinterpret_cast<const Pack<T, V>*>(p);
  Pack<float, V> values;
#pragma unroll
  for (int k = 0; k < V; ++k) values.v[k] = load(&raw.v[k]);
  return values;
}

template <int V, class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<float, V>& values) {
  Pack<T, V> raw;
#pragma unroll
  for (int k = 0; k < V; ++k) store(&raw.v[k], values.v[k]);
  *reinterpret_cast<Pack<T, V>*>(p) = raw;
}

inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(kernel) + " kernel launch failed: " + cudaGetErrorString(e));
}

// Calls f with a null pointer of the element type `dtype` names.
template <class F>
void with_type(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::Float: return f(static_cast<float*>(nullptr));
    case Dtype::BFloat16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case Dtype::Half: return f(static_cast<__half*>(nullptr));
  }
}

}  // namespace fsdp::kernels
