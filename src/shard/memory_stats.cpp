#include "shard/memory_stats.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

namespace fsdp {
namespace {

// Wraps the CPU allocator: each allocation carries its size in a small context, so its free is
// counted too. Lives for the whole process (tensors it allocated may outlive anything else).
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr inner = inner_->allocate(bytes);
    void* data = inner.get();
    const auto size = static_cast<int64_t>(bytes);
    const int64_t now = now_.fetch_add(size) + size;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    auto* owned = new Owned{std::move(inner), size, this};
    return {data, owned, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  AllocatedBytes read() const { return {now_.load(), peak_.load()}; }
  void reset_peak() { peak_.store(now_.load()); }

 private:
  struct Owned {
    c10::DataPtr inner;  // freed with this
    int64_t size;
    CountingCpuAllocator* counter;
  };
  static void release(void* context) {
    auto* owned = static_cast<Owned*>(context);
    owned->counter->now_.fetch_sub(owned->size);
    delete owned;
  }

  c10::Allocator* inner_;
  std::atomic<int64_t> now_{0}, peak_{0};
};

CountingCpuAllocator* g_host_counter = nullptr;
std::once_flag g_install_once;

}  // namespace

void count_host_allocations() {
  std::call_once(g_install_once, [] {
    g_host_counter = new CountingCpuAllocator(c10::GetCPUAllocator());
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
