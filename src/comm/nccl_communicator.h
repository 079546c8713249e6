// GPU collectives through NCCL, called directly (not through c10d's
// ProcessGroupNCCL) so that every collective runs on the stream the caller
// chose, allocates nothing behind the caller's back and never calls
// record_stream: buffer lifetimes stay with the FSDP runtime (src/shard/README.md).
#pragma once

#include <nccl.h>

#include <condition_variable>
#include <cuda_runtime_api.h>

#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "comm/backend_hooks.h"

namespace fsdp {

class NcclCommunicator : public Communicator {
 public:
  // Collective: every rank calls this with the id rank 0 made (ncclGetUniqueId).
  NcclCommunicator(int rank, int world_size, int device_index, const ncclUniqueId& id,
                   std::string name, std::chrono::milliseconds timeout);
  ~NcclCommunicator() override;

  const char* backend() const override { return "nccl"; }
  at::Device device() const override {
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
  }

 protected:
  FSDP_COMMUNICATOR_BACKEND_HOOKS

 private:
  // Takes ownership of `comm`, a communicator NCCL made (ncclCommSplit).
  NcclCommunicator(ncclComm_t comm, int device_index, std::string name, std::chrono::milliseconds timeout);
  struct InFlight {
    void* event;  // cudaEvent_t recorded after the collective; null while enqueuing
    std::string what;
    std::chrono::steady_clock::time_point start;
  };
  void check(ncclResult_t result, const std::string& what) const;
  void check_device(const at::Tensor& t, const std::string& what) const;
  // Enqueues a collective on the current stream under the watchdog's eye.
  void run(std::string what, const std::function<void(cudaStream_t)>& enqueue);
  void watchdog_loop();

  ncclComm_t comm_ = nullptr;
  int device_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<InFlight> in_flight_;
  bool stopping_ = false;
  std::thread watchdog_;
};

// Rank 0 makes the id that names a new NCCL communicator.
ncclUniqueId make_nccl_unique_id();

}  // namespace fsdp
