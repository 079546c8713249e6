#include "shard/streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <map>
#include <mutex>

namespace fsdp {

const DeviceStreams& DeviceStreams::of(const at::Device& device) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, std::unique_ptr<DeviceStreams>> all;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = all[{static_cast<int>(device.type()), device.has_index() ? device.index() : -1}];
  if (!slot) slot.reset(new DeviceStreams(device));
  return *slot;
}

DeviceStreams::DeviceStreams(const at::Device& device) : device_(device) {
  if (!device.is_cuda()) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  // High priority: communication kernels should start as soon as they can,
  // so that they overlap compute rather than queue behind it.
  all_gather_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  reduce_scatter_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  all_reduce_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
}

c10::Stream DeviceStreams::compute() const {
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

std::shared_ptr<c10::Event> DeviceStreams::record(const c10::Stream& stream) const {
  if (!active()) return nullptr;
  auto event = std::make_shared<c10::Event>(device_.type());
  event->record(stream);
  return event;
}

void DeviceStreams::wait(const c10::Stream& waiter, const c10::Event& event) const {
  if (active()) event.block(waiter);
}

void DeviceStreams::wait(const c10::Stream& waiter, const c10::Stream& from) const {
  if (active() && waiter != from) record(from)->block(waiter);
}

}  // namespace fsdp
