// The trainer's AdamW step: one pass over parameters, gradients (float32 or bf16) and moments,
// 16 bytes an access (8 for bf16 gradients and the bf16 copy), several accesses in flight per thread.
#include <cstdint>
#include <stdexcept>

#include "kernels/kernel_helpers.cuh"
#include "train/adamw_kernel.h"

namespace fsdp::kernels {
namespace {

// Tensors per launch: their descriptions travel as the kernel's parameter (4 KB at most).
constexpr int kMaxTensors = 32;
// Each thread takes kUnroll packs of 4 floats of each array per chunk, loaded before any is used.
constexpr int kUnroll = 4;
constexpr int64_t kChunk = int64_t(kThreads) * kUnroll * 4;

struct Launch {
  AdamWTensor tensors[kMaxTensors];
  int64_t first_block[kMaxTensors + 1];  // block b works on tensor i where first_block[i] <= b < first_block[i + 1]
  bool aligned[kMaxTensors];             // all four arrays 16-byte aligned: packed accesses
  int count;
};

struct Scalars {
  float lr, beta1, beta2, weight_decay, eps;
};

// ATen's adam_math for one element, in the same order of operations.
__device__ __forceinline__ void update(float& p, float g, float& m, float& v, const Scalars& s, float step_size,
                                       float bias_correction2_sqrt) {
  if (s.weight_decay != 0) p -= s.lr * s.weight_decay * p;
  m = fmaf(s.beta1, m, fmaf(-s.beta1, g, g));
  v = fmaf(s.beta2, v, fmaf(-s.beta2, g * g, g * g));
  const float denom = sqrtf(v) / bias_correction2_sqrt + s.eps;
  p -= step_size * m / denom;
}

// One block's chunk of tensor t, whose gradient has element type G (float32 or bf16; read into
// float32, exactly).
template <class G>
__device__ __forceinline__ void step_chunk(const AdamWTensor& t, bool aligned, int64_t start, const Scalars& s,
                                           const float* grad_divisor) {
  const int64_t left = t.numel - start, n = left < kChunk ? left : kChunk;
  const float step = *t.step;
  const float step_size = s.lr / (1 - powf(s.beta1, step));
  const float bias_correction2_sqrt = sqrtf(1 - powf(s.beta2, step));
  const float divisor = grad_divisor ? *grad_divisor : 1.0f;
  float* param = t.param + start;
  const G* grad = static_cast<const G*>(t.grad) + start;
  float* exp_avg = t.exp_avg + start;
  float* exp_avg_sq = t.exp_avg_sq + start;
  __nv_bfloat16* copy = t.compute_copy ? static_cast<__nv_bfloat16*>(t.compute_copy) + start : nullptr;
  int64_t done = 0;
  if (aligned) {
    const int64_t packs = n / 4;
    Pack<float, 4> p[kUnroll], g[kUnroll], m[kUnroll], v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = threadIdx.x + int64_t(u) * kThreads;
      if (k < packs) {
        p[u] = *reinterpret_cast<const Pack<float, 4>*>(param + 4 * k);
        g[u] = load_pack<4>(grad + 4 * k);
        m[u] = *reinterpret_cast<const Pack<float, 4>*>(exp_avg + 4 * k);
        v[u] = *reinterpret_cast<const Pack<float, 4>*>(exp_avg_sq + 4 * k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = threadIdx.x + int64_t(u) * kThreads;
      if (k < packs) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          update(p[u].v[e], grad_divisor ? g[u].v[e] / divisor : g[u].v[e], m[u].v[e], v[u].v[e], s, step_size,
                 bias_correction2_sqrt);
        *reinterpret_cast<Pack<float, 4>*>(param + 4 * k) = p[u];
        if (copy) store_pack<4>(copy + 4 * k, p[u]);
        *reinterpret_cast<Pack<float, 4>*>(exp_avg + 4 * k) = m[u];
        *reinterpret_cast<Pack<float, 4>*>(exp_avg_sq + 4 * k) = v[u];
      }
    }
    done = packs * 4;
  }
  for (int64_t k = done + threadIdx.x; k < n; k += kThreads) {  // the tail, or an unaligned tensor's chunk
    float p = param[k], m = exp_avg[k], v = exp_avg_sq[k];
    const float g = load(grad + k);
    update(p, grad_divisor ? g / divisor : g, m, v, s, step_size, bias_correction2_sqrt);
    param[k] = p;
    if (copy) store(copy + k, p);
    exp_avg[k] = m;
    exp_avg_sq[k] = v;
  }
}

__global__ void adamw_kernel(const __grid_constant__ Launch launch, Scalars s, const float* grad_divisor) {
  int i = 0;
  while (blockIdx.x >= launch.first_block[i + 1]) ++i;
  const AdamWTensor& t = launch.tensors[i];
  const int64_t start = (blockIdx.x - launch.first_block[i]) * kChunk;
  if (t.grad_dtype == Dtype::BFloat16)
    step_chunk<__nv_bfloat16>(t, launch.aligned[i], start, s, grad_divisor);
  else
    step_chunk<float>(t, launch.aligned[i], start, s, grad_divisor);
}

bool aligned_to(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void adamw_step(const std::vector<AdamWTensor>& tensors, const AdamWHyperparameters& h, const float* grad_divisor,
                void* stream) {
  // ATen's kernel takes its hyperparameters in float32 too.
  const Scalars s{float(h.lr), float(h.beta1), float(h.beta2), float(h.weight_decay), float(h.eps)};
  Launch launch{};
  const auto flush = [&] {
    if (launch.count == 0) return;
    const int64_t blocks = launch.first_block[launch.count];
    adamw_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(launch, s,
                                                                                                   grad_divisor);
    check_launch("adamw");
    launch = Launch{};
  };
  for (const AdamWTensor& t : tensors) {
    if (t.numel == 0) continue;
    const int i = launch.count++;
    launch.tensors[i] = t;
    if (t.grad_dtype != Dtype::Float && t.grad_dtype != Dtype::BFloat16)
      throw std::invalid_argument("adamw kernel: gradients must be float32 or bf16");
    const int grad_pack = t.grad_dtype == Dtype::Float ? 16 : 8;  // 4 elements
    launch.aligned[i] = aligned_to(t.param, 16) && aligned_to(t.grad, grad_pack) && aligned_to(t.exp_avg, 16) &&
                        aligned_to(t.exp_avg_sq, 16) && aligned_to(t.compute_copy, 8);
    launch.first_block[i + 1] = launch.first_block[i] + (t.numel + kChunk - 1) / kChunk;
    if (launch.count == kMaxTensors) flush();
  }
  flush();
}

}  // namespace fsdp::kernels
