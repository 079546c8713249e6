// Float8 casts with power-of-two scales (fsdp/float8.h): one pass over the input, the scale of each
// element computed from its amax in the kernel, the inverse scales written by the same launch.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "float8/float8_kernels.h"
#include "kernels/kernel_helpers.cuh"

namespace fsdp::kernels {
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

// kPack consecutive elements in float32: one 16-byte load of 16-bit types, two of float32.
template <class T>
__device__ __forceinline__ Pack<float, kPack> load_eight(const T* p) {
  if constexpr (sizeof(T) * kPack == 16) {
    return load_pack<kPack>(p);
  } else {
    const auto a = load_pack<4>(p), b = load_pack<4>(p + 4);
    Pack<float, kPack> v;
#pragma unroll
    for (int k = 0; k < 4; ++k) v.v[k] = a.v[k], v.v[k + 4] = b.v[k];
    return v;
  }
}

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
    const auto v = load_eight(x + p * kPack);
    Pack<uint8_t, kPack> result;
#pragma unroll
    for (int k = 0; k < kPack; ++k) result.v[k] = to_fp8<E5M2>(v.v[k] * scale);
    *reinterpret_cast<Pack<uint8_t, kPack>*>(out + p * kPack) = result;
  }
}

constexpr int kTile = 64;  // a block of 256 threads casts a 64 x 64 tile
constexpr int kTileThreads = 256;

// The largest |x| of each block into *out: packs of 8 elements in a grid-stride loop, the tail
// (n % 8 elements) by the first threads, then a warp and a block reduction and one atomicMax on the
// float's bits (for non-negative floats their order as integers).
template <class T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  float m = 0.0f;
  for (int64_t p = first; p < n / kPack; p += stride) {
    const auto v = load_eight(x + p * kPack);
#pragma unroll
    for (int k = 0; k < kPack; ++k) m = fmaxf(m, fabsf(v.v[k]));
  }
  for (int64_t i = n / kPack * kPack + first; i < n; i += stride) m = fmaxf(m, fabsf(load(x + i)));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  __shared__ float warp_max[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp != 0) return;
  m = lane < kThreads / 32 ? warp_max[lane] : 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (lane == 0) atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}

// Writes a staged 64 x 64 tile (rows row0.., columns col0.. of a [rows, cols] matrix) to out_t
// [cols, rows]: out_t's rows are the tile's columns, 64 of them, each 4 runs of 16 bytes.
__device__ __forceinline__ void write_transposed_tile(const uint8_t (&tile)[kTile][kTile + 4], uint8_t* out_t,
                                                      int64_t row0, int64_t col0, int64_t rows, int64_t cols) {
  const int c = threadIdx.x / (kTile / 16), r = (threadIdx.x % (kTile / 16)) * 16;
  const int64_t out_row = col0 + c, out_col = row0 + r;
  if (out_row >= cols || out_col >= rows) return;
  if (rows % 16 == 0) {  // 16-byte aligned, and the run is whole
    Pack<uint8_t, 16> run;
#pragma unroll
    for (int k = 0; k < 16; ++k) run.v[k] = tile[r + k][c];
    *reinterpret_cast<Pack<uint8_t, 16>*>(out_t + out_row * rows + out_col) = run;
  } else {
    for (int k = 0; k < 16 && out_col + k < rows; ++k) out_t[out_row * rows + out_col + k] = tile[r + k][c];
  }
}

// Transposed: out_t [cols, rows] = fp8(x^T * scale), scales per row of out_t (x's columns) or one;
// with out also written, out [rows, cols] = fp8(x * scale) from the same read (one scale only).
// Each thread reads 2 x 8 neighbouring elements of a tile row (16 bytes of bf16 each), casts them,
// writes them to `out` if asked and stages them in shared memory; then writes 16 consecutive bytes
// of a row of out_t (a column of the tile).
template <class T, bool E5M2>
__global__ void cast_transposed_kernel(const T* __restrict__ x, uint8_t* __restrict__ out_t,
                                       uint8_t* __restrict__ out, const float* __restrict__ amax, bool per_row,
                                       int64_t rows, int64_t cols, float max, float* __restrict__ inverse) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // + 4: a column's 16 bytes fall in distinct banks
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const float whole = per_row ? 0.0f : power_of_two_scale(amax[0], max);
#pragma unroll
  for (int pass = 0; pass < kTile * kTile / kPack / kTileThreads; ++pass) {
    const int chunk = pass * kTileThreads + threadIdx.x;  // 8 chunks of 8 elements a tile row
    const int r = chunk / (kTile / kPack), c = (chunk % (kTile / kPack)) * kPack;
    const int64_t row = row0 + r, col = col0 + c;
    if (row >= rows || col >= cols) continue;  // cols % 16 == 0: a chunk is inside or outside
    const auto v = load_eight(x + row * cols + col);
    Pack<uint8_t, kPack> result;
#pragma unroll
    for (int k = 0; k < kPack; ++k)
      result.v[k] = to_fp8<E5M2>(v.v[k] * (per_row ? power_of_two_scale(amax[col + k], max) : whole));
    if (out) *reinterpret_cast<Pack<uint8_t, kPack>*>(out + row * cols + col) = result;
#pragma unroll
    for (int k = 0; k < kPack; ++k) tile[r][c + k] = result.v[k];
    if (row == 0 && (per_row || col == 0))
      for (int k = 0; k < (per_row ? kPack : 1); ++k)
        inverse[per_row ? col + k : 0] = 1.0f / (per_row ? power_of_two_scale(amax[col + k], max) : whole);
  }
  __syncthreads();
  write_transposed_tile(tile, out_t, row0, col0, rows, cols);
}

// in [rows, cols] -> out_t [cols, rows], 1-byte elements (rows and cols multiples of 16): each
// thread reads 16 bytes of a tile row into shared memory, then writes 16 bytes of a tile column.
__global__ void transpose_bytes_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out_t, int64_t rows,
                                       int64_t cols) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const int r = threadIdx.x / (kTile / 16), c = (threadIdx.x % (kTile / 16)) * 16;
  if (row0 + r < rows && col0 + c < cols) {
    const auto run = *reinterpret_cast<const Pack<uint8_t, 16>*>(in + (row0 + r) * cols + col0 + c);
#pragma unroll
    for (int k = 0; k < 16; ++k) tile[r][c + k] = run.v[k];
  }
  __syncthreads();
  write_transposed_tile(tile, out_t, row0, col0, rows, cols);
}

}  // namespace

void float8_cast(const void* x, Dtype dtype, int64_t rows, int64_t cols, const float* amax, bool per_row,
                 void* out, void* out_transposed, bool e5m2, float* inverse_scale, void* stream) {
  if (rows * cols == 0) return;
  if (cols % 16 != 0) throw std::invalid_argument("float8_cast: columns must be a multiple of 16");
  if (rows / kTile + 1 > 65535) throw std::invalid_argument("float8_cast: more than 65535 * 64 rows");
  if (out && out_transposed && per_row)
    throw std::invalid_argument("float8_cast: both layouts at once share one scale (per_row false)");
  const float max = e5m2 ? 57344.0f : 448.0f;
  const auto s = static_cast<cudaStream_t>(stream);
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const auto* in = static_cast<const T*>(x);
    auto* plain = static_cast<uint8_t*>(out);
    if (out_transposed) {
      const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
      const auto kernel = e5m2 ? cast_transposed_kernel<T, true> : cast_transposed_kernel<T, false>;
      kernel<<<grid, kTileThreads, 0, s>>>(in, static_cast<uint8_t*>(out_transposed), plain, amax, per_row, rows, cols,
                                           max, inverse_scale);
    } else {
      const int64_t packs = rows * cols / kPack;
      const auto blocks = static_cast<unsigned>(std::min<int64_t>((packs + kThreads - 1) / kThreads, 65536));
      const auto kernel = e5m2 ? cast_kernel<T, true> : cast_kernel<T, false>;
      kernel<<<blocks, kThreads, 0, s>>>(in, plain, amax, per_row, rows, cols, max, inverse_scale);
    }
  });
  check_launch(out_transposed ? "float8_cast (transposed)" : "float8_cast");
}

void amax(const void* x, Dtype dtype, int64_t n, float* amax, void* stream) {
  if (n == 0) return;
  // Enough blocks to fill the GPU several times over; each thread then loops.
  const auto blocks = static_cast<unsigned>(std::clamp<int64_t>((n / kPack + kThreads - 1) / kThreads, 1, 1024));
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    amax_kernel<T><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<const T*>(x), n, amax);
  });
  check_launch("amax");
}

void transpose_bytes(const void* in, void* out, int64_t rows, int64_t cols, void* stream) {
  if (rows * cols == 0) return;
  if (rows % 16 != 0 || cols % 16 != 0)
    throw std::invalid_argument("transpose_bytes: rows and columns must be multiples of 16");
  if (rows / kTile + 1 > 65535) throw std::invalid_argument("transpose_bytes: more than 65535 * 64 rows");
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  transpose_bytes_kernel<<<grid, kTileThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(in), static_cast<uint8_t*>(out), rows, cols);
  check_launch("transpose_bytes");
}

int compute_capability(int device) {
  cudaDeviceProp properties;
  if (cudaGetDeviceProperties(&properties, device) != cudaSuccess)
    throw std::runtime_error("cudaGetDeviceProperties failed for GPU " + std::to_string(device));
  return properties.major * 10 + properties.minor;
}

}  // namespace fsdp::kernels
