// The host-memory counter (include/fsdp/memory_stats.h) keeps c10's contract for CPU allocators:
// every caller of the CPU allocator, raw_allocate included (oneDNN's scratch memory and layout
// conversions take that path), works while it counts. The same on every x86 CPU: the oneDNN
// calls below do not depend on the instructions the CPU has.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Config.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fsdp/memory_stats.h"

namespace {

int64_t host_now() { return fsdp::allocated_bytes(c10::Device(c10::kCPU)).now; }

TEST(HostMemory, RawAllocationsAreCountedAndFreedThroughTheRawDeleter) {
  fsdp::count_host_allocations();
  c10::Allocator* cpu = c10::GetCPUAllocator();
  ASSERT_NE(cpu->raw_deleter(), nullptr) << "raw_deallocate would assert";
  const int64_t before = host_now();
  void* raw = cpu->raw_allocate(1000);  // asserts context == data inside c10
  EXPECT_EQ(reinterpret_cast<uintptr_t>(raw) % c10::gAlignment, 0u);
  std::memset(raw, 0x5a, 1000);
  EXPECT_EQ(host_now() - before, 1000);
  cpu->raw_deallocate(raw);
  EXPECT_EQ(host_now(), before);

  const auto peak_before = fsdp::allocated_bytes(c10::Device(c10::kCPU)).peak;
  {
    at::Tensor t = at::empty({1 << 16}, at::kFloat);  // through allocate(): a tensor's storage
    EXPECT_EQ(host_now() - before, int64_t{4} << 16);
    EXPECT_TRUE(cpu->is_simple_data_ptr(t.storage().data_ptr()));
  }
  EXPECT_EQ(host_now(), before);
  EXPECT_GE(fsdp::allocated_bytes(c10::Device(c10::kCPU)).peak, std::max(peak_before, before + (int64_t{4} << 16)));
  at::Tensor empty = at::empty({0}, at::kFloat);  // no bytes: nothing counted, nothing to free
  EXPECT_EQ(host_now(), before);
}

TEST(HostMemory, OneDnnWorksWhileCounted) {
  if (!at::hasMKLDNN()) GTEST_SKIP() << "this libtorch has no oneDNN";
  fsdp::count_host_allocations();
  const int64_t before = host_now();
  at::manual_seed(0);
  const at::Tensor x = at::randn({64, 96});
  // The layout conversions allocate through raw_allocate: the path that asserted before.
  const at::Tensor blocked = x.to_mkldnn();
  EXPECT_TRUE(at::equal(blocked.to_dense(), x));
  // A linear layer on oneDNN's own kernel: its weights' reorder and scratch memory too.
  const at::Tensor w = at::randn({32, 96});
  const at::Tensor y = at::mkldnn_linear(blocked, w, std::nullopt).to_dense();
  // Float32 dot products of 96 terms of |x w| <= ~16: error bound 96 * 2^-24 * sum|x||w|.
  const at::Tensor reference = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
  const double bound =
      96 * std::ldexp(1.0, -24) * at::matmul(x.abs().to(at::kDouble), w.abs().to(at::kDouble).t()).max().item<double>();
  EXPECT_LE((y.to(at::kDouble) - reference).abs().max().item<double>(), bound);
  EXPECT_GE(host_now() - before, 4 * 64 * 96);  // at least x, still held
}

}  // namespace
