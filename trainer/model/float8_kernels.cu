// Float8 casts with power-of-two scales (model/float8.h): one pass over the input, the scale of each
// element computed from its amax in the kernel, the inverse scales written by the same launch.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "model/kernel_helpers.cuh"

namespace fsdp::model::kernels {
namespace {

// The largest power of two s with amax * s <= max (amax clamped away from zero, as float8.cpp's
// reference): max / amax = m * 2^e with m in [0.5, 1), so s = 2^(e - 1).
__device__ __forceinline__ float power_of_two_scale(float amax, float max) {
  int exponent;
  frexpf(max / fmaxf(amax, 1e-12f), &exponent);
  return ldexpf(1.0f, exponent - 1);
}

template <bool E5M2>
__device__ __forceinline__ uint8_t to_fp8(float scaled) {
  return __nv_cvt_float_to_fp8(scaled, __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3);
}

constexpr int kPack = 8;  // elements a thread casts at once (16 bytes of bf16 in, 8 bytes out)

// out [rows, cols] = fp8(x * scale): thread i casts elements [8 i, 8 i + 8) (cols % 8 == 0, so a
// pack never crosses rows). Grid-stride over packs.
template <class T, bool E5M2>
__global__ void cast_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, const float* __restrict__ amax,
                            bool per_row, int64_t rows, int64_t cols, float max, float* __restrict__ inverse) {
  const int64_t packs = rows * cols / kPack, packs_per_row = cols / kPack;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = p / packs_per_row;
    const float scale = power_of_two_scale(amax[per_row ? row : 0], max);
    if (p % packs_per_row == 0 && (per_row || row == 0)) inverse[per_row ? row : 0] = 1.0f / scale;
    Pack<float, kPack> v;
    if constexpr (sizeof(T) * kPack == 16) {
      v = load_pack<kPack>(x + p * kPack);
    } else {  // float32: two 16-byte loads
      const auto a = load_pack<4>(x + p * kPack), b = load_pack<4>(x + p * kPack + 4);
#pragma unroll
      for (int k = 0; k < 4; ++k) v.v[k] = a.v[k], v.v[k + 4] = b.v[k];
    }
    Pack<uint8_t, kPack> result;
#pragma unroll
    for (int k = 0; k < kPack; ++k) result.v[k] = to_fp8<E5M2>(v.v[k] * scale);
    *reinterpret_cast<Pack<uint8_t, kPack>*>(out + p * kPack) = result;
  }
}

constexpr int kTile = 64;  // a block transposes a 64 x 64 tile with 32 x 8 threads

// out [cols, rows] = fp8(x^T * scale), scales per row of out (x's columns) or one. The tile is
// read with each thread taking 2 neighbouring columns of 8 rows, cast, staged in shared memory
// and written transposed the same way.
template <class T, bool E5M2>
__global__ void cast_transposed_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                                       const float* __restrict__ amax, bool per_row, int64_t rows, int64_t cols,
                                       float max, float* __restrict__ inverse) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // + 4: the transposed reads (stride 17 words) hit distinct banks
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  float scale[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t col = col0 + 2 * tx + j;
    scale[j] = power_of_two_scale(amax[per_row ? (col < cols ? col : 0) : 0], max);
    if (ty == 0 && blockIdx.y == 0 && col < cols && (per_row || col == 0)) inverse[per_row ? col : 0] = 1.0f / scale[j];
  }
#pragma unroll
  for (int k = 0; k < kTile / 8; ++k) {
    const int r = ty + 8 * k;
    const int64_t row = row0 + r;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t col = col0 + 2 * tx + j;
      if (row < rows && col < cols) tile[r][2 * tx + j] = to_fp8<E5M2>(load(x + row * cols + col) * scale[j]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kTile / 8; ++k) {
    const int c = ty + 8 * k;
    const int64_t out_row = col0 + c;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t out_col = row0 + 2 * tx + j;
      if (out_row < cols && out_col < rows) out[out_row * rows + out_col] = tile[2 * tx + j][c];
    }
  }
}

}  // namespace

void float8_cast(const void* x, Dtype dtype, int64_t rows, int64_t cols, const float* amax, bool per_row,
                 bool transposed, bool e5m2, void* out, float* inverse_scale, void* stream) {
  if (rows * cols == 0) return;
  if (cols % 16 != 0) throw std::invalid_argument("float8_cast: columns must be a multiple of 16");
  if (rows / kTile + 1 > 65535) throw std::invalid_argument("float8_cast: more than 65535 * 64 rows");
  const float max = e5m2 ? 57344.0f : 448.0f;
  const auto s = static_cast<cudaStream_t>(stream);
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const auto* in = static_cast<const T*>(x);
    auto* o = static_cast<uint8_t*>(out);
    if (transposed) {
      const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
      const dim3 block(32, 8);
      const auto kernel = e5m2 ? cast_transposed_kernel<T, true> : cast_transposed_kernel<T, false>;
      kernel<<<grid, block, 0, s>>>(in, o, amax, per_row, rows, cols, max, inverse_scale);
    } else {
      const int64_t packs = rows * cols / kPack;
      const auto blocks = static_cast<unsigned>(std::min<int64_t>((packs + kThreads - 1) / kThreads, 65536));
      const auto kernel = e5m2 ? cast_kernel<T, true> : cast_kernel<T, false>;
      kernel<<<blocks, kThreads, 0, s>>>(in, o, amax, per_row, rows, cols, max, inverse_scale);
    }
  });
  check_launch(transposed ? "float8_cast (transposed)" : "float8_cast");
}

int compute_capability(int device) {
  cudaDeviceProp properties;
  if (cudaGetDeviceProperties(&properties, device) != cudaSuccess)
    throw std::runtime_error("cudaGetDeviceProperties failed for GPU " + std::to_string(device));
  return properties.major * 10 + properties.minor;
}

}  // namespace fsdp::model::kernels
