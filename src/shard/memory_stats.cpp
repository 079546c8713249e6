#include "fsdp/memory_stats.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>

namespace fsdp {
namespace {

// Wraps the CPU allocator's raw allocations and counts their bytes. c10's contract for a CPU
// allocator (raw_allocate asserts it; oneDNN's scratch memory goes through it) is that a DataPtr's
// context is its data and raw_deleter() frees it, so the size cannot ride in a separate context:
// each block carries it in a header of kHeaderBytes just before the data, which keeps the inner
// allocator's alignment (c10::gAlignment divides kHeaderBytes). Lives for the whole process
// (tensors it allocated may outlive anything else).
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) return {nullptr, nullptr, &release, c10::Device(c10::kCPU)};
    auto* block = static_cast<char*>(inner_->raw_allocate(bytes + kHeaderBytes));
    new (block) Header{static_cast<int64_t>(bytes), this};
    add(static_cast<int64_t>(bytes));
    void* data = block + kHeaderBytes;
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  AllocatedBytes read() const { return {now_.load(), peak_.load()}; }
  void reset_peak() { peak_.store(now_.load()); }

 private:
  static constexpr size_t kHeaderBytes = 64;
  struct Header {
    int64_t size;
    CountingCpuAllocator* counter;
  };
  static_assert(sizeof(Header) <= kHeaderBytes && kHeaderBytes % alignof(std::max_align_t) == 0);

  void add(int64_t size) {
    const int64_t now = now_.fetch_add(size) + size;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  static void release(void* data) {
    if (data == nullptr) return;
    auto* block = static_cast<char*>(data) - kHeaderBytes;
    const Header header = *reinterpret_cast<Header*>(block);
    header.counter->now_.fetch_sub(header.size);
    header.counter->inner_->raw_deallocate(block);
  }

  c10::Allocator* inner_;
  std::atomic<int64_t> now_{0}, peak_{0};
};

CountingCpuAllocator* g_host_counter = nullptr;
std::once_flag g_install_once;

}  // namespace

void count_host_allocations() {
  std::call_once(g_install_once, [] {
    // The allocator in place, unless it cannot free raw blocks (then c10's default, which can).
    c10::Allocator* inner = c10::GetCPUAllocator();
    if (inner->raw_deleter() == nullptr) inner = c10::GetDefaultCPUAllocator();
    g_host_counter = new CountingCpuAllocator(inner);
    // Above the default's priority 0, so it is the allocator every CPU tensor gets from now on.
    c10::SetCPUAllocator(g_host_counter, /*priority=*/1);
  });
}

bool counting_host_allocations() { return g_host_counter != nullptr; }

AllocatedBytes allocated_bytes(const c10::Device& device) {
  if (device.is_cpu()) return g_host_counter ? g_host_counter->read() : AllocatedBytes{};
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
  const auto& all = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return {all.current, all.peak};
}

void reset_peak_allocated(const c10::Device& device) {
  if (device.is_cpu()) {
    if (g_host_counter) g_host_counter->reset_peak();
    return;
  }
  c10::getDeviceAllocator(device.type())->resetPeakStats(device.index());
}

}  // namespace fsdp
