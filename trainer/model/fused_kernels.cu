// The Llama's elementwise kernels: one pass over memory each, float32 arithmetic, one rounding.
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <type_traits>

#include "kernels/kernel_helpers.cuh"
#include "model/fused_kernels.h"

namespace fsdp::kernels {
namespace {

// One block per row (batch x seq position); its threads stride over the row's (head, V pairs) slots.
template <class T, int V>
__global__ void rope_kernel(const T* __restrict__ in, T* __restrict__ out, const float* __restrict__ cos,
                            const float* __restrict__ sin, int seq, int heads, int rotated_heads, int half,
                            float sign) {
  const int64_t row = blockIdx.x;
  const float* row_cos = cos + (row % seq) * half;
  const float* row_sin = sin + (row % seq) * half;
  const T* x = in + row * heads * 2 * half;
  T* y = out + row * heads * 2 * half;
  const int packs = half / V;  // per head
  for (int slot = threadIdx.x; slot < heads * packs; slot += blockDim.x) {
    const int head = slot / packs, i = (slot % packs) * V, at = head * 2 * half + i;
    const auto x1 = load_pack<V>(x + at), x2 = load_pack<V>(x + at + half);
    if (head < rotated_heads) {
      const auto c = load_pack<V>(row_cos + i), s = load_pack<V>(row_sin + i);
      Pack<float, V> y1, y2;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float sk = sign * s.v[k];
        y1.v[k] = x1.v[k] * c.v[k] - x2.v[k] * sk;
        y2.v[k] = x2.v[k] * c.v[k] + x1.v[k] * sk;
      }
      store_pack<V>(y + at, y1);
      store_pack<V>(y + at + half, y2);
    } else {
      store_pack<V>(y + at, x1);
      store_pack<V>(y + at + half, x2);
    }
  }
}

// One block per row; gate is the first half of the row, up the second.
template <class T, int V>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int ffn) {
  const T* gate = gate_up + int64_t(blockIdx.x) * 2 * ffn;
  const T* up = gate + ffn;
  T* y = out + int64_t(blockIdx.x) * ffn;
  for (int j = threadIdx.x * V; j < ffn; j += blockDim.x * V) {
    const auto g = load_pack<V>(gate + j), u = load_pack<V>(up + j);
    Pack<float, V> result;
#pragma unroll
    for (int k = 0; k < V; ++k) result.v[k] = g.v[k] / (1.0f + expf(-g.v[k])) * u.v[k];
    store_pack<V>(y + j, result);
  }
}

template <class T, int V>
__global__ void swiglu_backward_kernel(const T* __restrict__ gate_up, const T* __restrict__ grad_out,
                                       T* __restrict__ grad_gate_up, int ffn) {
  const int64_t at = int64_t(blockIdx.x) * 2 * ffn;
  const T* go_row = grad_out + int64_t(blockIdx.x) * ffn;
  for (int j = threadIdx.x * V; j < ffn; j += blockDim.x * V) {
    const auto g = load_pack<V>(gate_up + at + j), u = load_pack<V>(gate_up + at + ffn + j);
    const auto go = load_pack<V>(go_row + j);
    Pack<float, V> grad_gate, grad_up;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float sig = 1.0f / (1.0f + expf(-g.v[k]));
      grad_gate.v[k] = go.v[k] * u.v[k] * sig * (1.0f + g.v[k] * (1.0f - sig));  // d silu(g) / dg
      grad_up.v[k] = go.v[k] * g.v[k] * sig;
    }
    store_pack<V>(grad_gate_up + at + j, grad_gate);
    store_pack<V>(grad_gate_up + at + ffn + j, grad_up);
  }
}

// A row's running softmax denominator: its largest value so far and the sum of exp(x - max).
struct Softmax {
  float max = -INFINITY, sum = 0;
  __device__ void add(float x) {
    if (x > max) {
      sum = sum * expf(max - x) + 1.0f;
      max = x;
    } else {
      sum += expf(x - max);  // NaN stays NaN: a NaN logit gives a NaN loss
    }
  }
  __device__ void merge(const Softmax& o) {
    if (o.max == -INFINITY) return;
    if (max == -INFINITY) {
      *this = o;
      return;
    }
    const float m = fmaxf(max, o.max);
    sum = sum * expf(max - m) + o.sum * expf(o.max - m);
    max = m;
  }
};

// One block per row of logits: the row's cross-entropy in float32, and where `gradients`, the row
// overwritten (in place) with the gradient of the mean loss, (softmax - one_hot(target)) / rows,
// rounded once. Two reads of the row and one write, where the unfused float32 operations made ten
// passes over a float32 copy.
template <class T, int V>
__global__ void cross_entropy_kernel(T* __restrict__ logits, const int64_t* __restrict__ targets,
                                     float* __restrict__ row_loss, int64_t vocab, float rows, bool gradients) {
  T* row = logits + int64_t(blockIdx.x) * vocab;
  Softmax local;
  for (int64_t j = int64_t(threadIdx.x) * V; j < vocab; j += int64_t(blockDim.x) * V) {
    const auto x = load_pack<V>(row + j);
#pragma unroll
    for (int k = 0; k < V; ++k) local.add(x.v[k]);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    Softmax other;
    other.max = __shfl_down_sync(0xffffffff, local.max, offset);
    other.sum = __shfl_down_sync(0xffffffff, local.sum, offset);
    local.merge(other);
  }
  __shared__ Softmax warps[32];
  __shared__ Softmax whole;
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < blockDim.x / 32; ++w) warps[0].merge(warps[w]);
    whole = warps[0];
    const int64_t target = targets[blockIdx.x];
    // A target outside the vocabulary has no loss: NaN, which the trainer reports, not a crash.
    row_loss[blockIdx.x] = target < 0 || target >= vocab ? NAN : logf(whole.sum) - (load(row + target) - whole.max);
  }
  __syncthreads();  // the target's logit is read before the row is overwritten
  if (!gradients) return;
  const int64_t target = targets[blockIdx.x];
  const float denominator = whole.sum * rows, minus_inv_rows = -1.0f / rows;
  for (int64_t j = int64_t(threadIdx.x) * V; j < vocab; j += int64_t(blockDim.x) * V) {
    auto x = load_pack<V>(row + j);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      x.v[k] = expf(x.v[k] - whole.max) / denominator;
      if (j + k == target) x.v[k] += minus_inv_rows;
    }
    store_pack<V>(row + j, x);
  }
}

// Whether every pointer is aligned to `bytes` (row lengths are checked by the callers).
bool aligned(int64_t bytes, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0) return false;
  return true;
}

// One block per row: the grid's x dimension holds up to 2^31 - 1 rows.
dim3 grid_of(int64_t rows) {
  if (rows > 0x7fffffff) throw std::invalid_argument("fused kernel: more than 2^31 - 1 rows");
  return dim3(static_cast<unsigned>(rows));
}

}  // namespace

void rope(const void* in, void* out, const float* cos, const float* sin, int64_t rows, int64_t seq,
          int64_t heads, int64_t rotated_heads, int64_t head_dim, bool inverse, Dtype dtype, void* stream) {
  if (rows * heads * head_dim == 0) return;
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    constexpr int V = kVector<T>;
    const int64_t half = head_dim / 2;
    const bool packed = half % V == 0 && aligned(16, {in, out}) && aligned(sizeof(float) * V, {cos, sin});
    const auto kernel = packed ? rope_kernel<T, V> : rope_kernel<T, 1>;
    kernel<<<grid_of(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(in), static_cast<T*>(out), cos, sin, static_cast<int>(seq), static_cast<int>(heads),
        static_cast<int>(rotated_heads), static_cast<int>(half), inverse ? -1.0f : 1.0f);
  });
  check_launch("rope");
}

void swiglu_forward(const void* gate_up, void* out, int64_t rows, int64_t ffn, Dtype dtype, void* stream) {
  if (rows * ffn == 0) return;
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    constexpr int V = kVector<T>;
    const auto kernel = ffn % V == 0 && aligned(16, {gate_up, out}) ? swiglu_forward_kernel<T, V>
                                                                    : swiglu_forward_kernel<T, 1>;
    kernel<<<grid_of(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(gate_up), static_cast<T*>(out), static_cast<int>(ffn));
  });
  check_launch("swiglu_forward");
}

void swiglu_backward(const void* gate_up, const void* grad_out, void* grad_gate_up, int64_t rows, int64_t ffn,
                     Dtype dtype, void* stream) {
  if (rows * ffn == 0) return;
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    constexpr int V = kVector<T>;
    const auto kernel = ffn % V == 0 && aligned(16, {gate_up, grad_out, grad_gate_up}) ? swiglu_backward_kernel<T, V>
                                                                                       : swiglu_backward_kernel<T, 1>;
    kernel<<<grid_of(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(gate_up), static_cast<const T*>(grad_out), static_cast<T*>(grad_gate_up),
        static_cast<int>(ffn));
  });
  check_launch("swiglu_backward");
}

void cross_entropy(void* logits, const int64_t* targets, float* row_loss, int64_t rows, int64_t vocab,
                   int64_t mean_over, bool gradients, Dtype dtype, void* stream) {
  if (rows * vocab == 0) return;
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    constexpr int V = kVector<T>;
    const auto kernel = vocab % V == 0 && aligned(16, {logits}) ? cross_entropy_kernel<T, V>
                                                                 : cross_entropy_kernel<T, 1>;
    kernel<<<grid_of(rows), 2 * kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(logits), targets, row_loss, vocab, static_cast<float>(mean_over), gradients);
  });
  check_launch("cross_entropy");
}

}  // namespace fsdp::kernels
