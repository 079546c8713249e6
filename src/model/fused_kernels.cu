// The Llama's elementwise kernels: one pass over memory each, float32 arithmetic, one rounding.
#include "model/fused_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace fsdp::model::kernels {
namespace {

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

constexpr int kThreads = 256;

// One block per row (batch x seq position); its threads stride over the row's (head, pair) slots.
template <class T>
__global__ void rope_kernel(const T* __restrict__ in, T* __restrict__ out, const float* __restrict__ cos,
                            const float* __restrict__ sin, int seq, int heads, int rotated_heads, int half,
                            float sign) {
  const int64_t row = blockIdx.x;
  const float* row_cos = cos + (row % seq) * half;
  const float* row_sin = sin + (row % seq) * half;
  const T* x = in + row * heads * 2 * half;
  T* y = out + row * heads * 2 * half;
  for (int slot = threadIdx.x; slot < heads * half; slot += blockDim.x) {
    const int head = slot / half, i = slot % half, at = head * 2 * half + i;
    const float x1 = load(x + at), x2 = load(x + at + half);
    if (head < rotated_heads) {
      const float c = row_cos[i], s = sign * row_sin[i];
      store(y + at, x1 * c - x2 * s);
      store(y + at + half, x2 * c + x1 * s);
    } else {
      store(y + at, x1);
      store(y + at + half, x2);
    }
  }
}

// One block per row; gate is the first half of the row, up the second.
template <class T>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int ffn) {
  const T* gate = gate_up + int64_t(blockIdx.x) * 2 * ffn;
  const T* up = gate + ffn;
  T* y = out + int64_t(blockIdx.x) * ffn;
  for (int j = threadIdx.x; j < ffn; j += blockDim.x) {
    const float g = load(gate + j);
    store(y + j, g / (1.0f + expf(-g)) * load(up + j));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* __restrict__ gate_up, const T* __restrict__ grad_out,
                                       T* __restrict__ grad_gate_up, int ffn) {
  const int64_t at = int64_t(blockIdx.x) * 2 * ffn;
  const T* go_row = grad_out + int64_t(blockIdx.x) * ffn;
  for (int j = threadIdx.x; j < ffn; j += blockDim.x) {
    const float g = load(gate_up + at + j), u = load(gate_up + at + ffn + j), go = load(go_row + j);
    const float sig = 1.0f / (1.0f + expf(-g));
    store(grad_gate_up + at + j, go * u * sig * (1.0f + g * (1.0f - sig)));  // d silu(g) / dg
    store(grad_gate_up + at + ffn + j, go * g * sig);
  }
}

// One block per row: the grid's x dimension holds up to 2^31 - 1 rows.
dim3 grid_of(int64_t rows) {
  if (rows > 0x7fffffff) throw std::invalid_argument("fused kernel: more than 2^31 - 1 rows");
  return dim3(static_cast<unsigned>(rows));
}

void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(kernel) + " kernel launch failed: " + cudaGetErrorString(e));
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

}  // namespace

void rope(const void* in, void* out, const float* cos, const float* sin, int64_t rows, int64_t seq,
          int64_t heads, int64_t rotated_heads, int64_t head_dim, bool inverse, Dtype dtype, void* stream) {
  if (rows * heads * head_dim == 0) return;
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rope_kernel<T><<<grid_of(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(in), static_cast<T*>(out), cos, sin, static_cast<int>(seq), static_cast<int>(heads),
        static_cast<int>(rotated_heads), static_cast<int>(head_dim / 2), inverse ? -1.0f : 1.0f);
  });
  check_launch("rope");
}

void swiglu_forward(const void* gate_up, void* out, int64_t rows, int64_t ffn, Dtype dtype, void* stream) {
  if (rows * ffn == 0) return;
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    swiglu_forward_kernel<T><<<grid_of(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(gate_up), static_cast<T*>(out), static_cast<int>(ffn));
  });
  check_launch("swiglu_forward");
}

void swiglu_backward(const void* gate_up, const void* grad_out, void* grad_gate_up, int64_t rows, int64_t ffn,
                     Dtype dtype, void* stream) {
  if (rows * ffn == 0) return;
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    swiglu_backward_kernel<T><<<grid_of(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(gate_up), static_cast<const T*>(grad_out), static_cast<T*>(grad_gate_up),
        static_cast<int>(ffn));
  });
  check_launch("swiglu_backward");
}

}  // namespace fsdp::model::kernels
