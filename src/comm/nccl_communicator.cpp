#include "comm/nccl_communicator.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <ATen/ops/zeros.h>

#include <cstdio>
#include <cstdlib>

#include "comm/collective_names.h"

namespace fsdp {
namespace {

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte:
    case at::kBool: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: throw CollectiveError(std::string("fsdp: the NCCL backend does not support dtype ") +
                                   c10::toString(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Avg ? ncclAvg : ncclSum; }

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw CollectiveError(std::string("fsdp: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

ncclUniqueId make_nccl_unique_id() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess)
    throw CollectiveError(std::string("fsdp: ncclGetUniqueId failed: ") + ncclGetErrorString(r));
  return id;
}

NcclCommunicator::NcclCommunicator(int rank, int world_size, int device_index,
                                   const ncclUniqueId& id, std::string name,
                                   std::chrono::milliseconds timeout)
    : Communicator(rank, world_size, std::move(name), timeout), device_(device_index) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  check(ncclCommInitRank(&comm_, world_size, id, rank), "ncclCommInitRank");
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

namespace {
int rank_in(ncclComm_t comm) {
  int rank = 0;
  ncclCommUserRank(comm, &rank);
  return rank;
}
int size_of(ncclComm_t comm) {
  int size = 0;
  ncclCommCount(comm, &size);
  return size;
}
}  // namespace

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int device_index, std::string name,
                                   std::chrono::milliseconds timeout)
    : Communicator(rank_in(comm), size_of(comm), std::move(name), timeout), comm_(comm), device_(device_index) {
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

std::shared_ptr<Communicator> NcclCommunicator::do_split(int color, int key, std::string name) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  ncclComm_t part = nullptr;
  check(ncclCommSplit(comm_, color, key, &part, nullptr), "ncclCommSplit into '" + name + "'");
  return std::shared_ptr<Communicator>(new NcclCommunicator(part, device_, std::move(name), timeout()));
}

NcclCommunicator::~NcclCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  for (auto& f : in_flight_) cudaEventDestroy(static_cast<cudaEvent_t>(f.event));
  if (comm_) ncclCommDestroy(comm_);
}

void NcclCommunicator::check(ncclResult_t result, const std::string& what) const {
  if (result == ncclSuccess) return;
  std::string detail = comm_ ? ncclGetLastError(comm_) : "";
  throw CollectiveError("fsdp: " + what + " on " + describe() + " failed: " +
                        ncclGetErrorString(result) + (detail.empty() ? "" : " (" + detail + ")"));
}

void NcclCommunicator::check_device(const at::Tensor& t, const std::string& what) const {
  if (t.device().index() != device_)
    throw CollectiveError("fsdp: " + what + " on " + describe() + ": tensor is on " +
                          t.device().str() + " but this rank's communicator uses cuda:" +
                          std::to_string(device_));
}

void NcclCommunicator::run(std::string what, const std::function<void(cudaStream_t)>& enqueue) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  {
    // Watched from before the call: NCCL's first collective on a connection
    // blocks the CPU until the peer arrives, so a dead peer can hang us here.
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.push_back({nullptr, what, std::chrono::steady_clock::now()});
  }
  wake_.notify_all();
  cudaEvent_t event = nullptr;
  try {
    enqueue(stream);
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(event, stream), "cudaEventRecord");
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.pop_back();
    if (event) cudaEventDestroy(event);
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  in_flight_.back().event = event;
}

// Polls the oldest collective. One still enqueuing or running after the
// timeout means a peer died or diverged: report which, and end the process,
// as the CPU side may be blocked in a call that would otherwise never return.
void NcclCommunicator::watchdog_loop() {
  cudaSetDevice(device_);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, std::chrono::milliseconds(100));
    while (!in_flight_.empty()) {
      InFlight& oldest = in_flight_.front();
      if (oldest.event &&
          cudaEventQuery(static_cast<cudaEvent_t>(oldest.event)) == cudaSuccess) {
        cudaEventDestroy(static_cast<cudaEvent_t>(oldest.event));
        in_flight_.pop_front();
        continue;
      }
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async_error);
      bool late = std::chrono::steady_clock::now() - oldest.start > timeout();
      if (late || async_error != ncclSuccess) {
        const std::string message =
            late ? timeout_message(oldest.what)
                 : "fsdp: " + oldest.what + " on " + describe() + " failed: " +
                       ncclGetErrorString(async_error) + " (" + ncclGetLastError(comm_) + ")";
        std::fprintf(stderr, "%s Aborting this process.\n", message.c_str());
        std::fflush(stderr);
        // Aborting frees the GPU from the stuck kernel; a thread still inside
        // an NCCL call (no event yet) may hold NCCL's locks, so then just exit.
        if (oldest.event) ncclCommAbort(comm_);
        std::_Exit(EXIT_FAILURE);
      }
      break;
    }
  }
}

void NcclCommunicator::do_all_gather(const std::vector<Buffers>& ops, const std::string& tag) {
  for (const auto& op : ops) {
    check_device(op.input, "all_gather");
    check_device(op.output, "all_gather");
  }
  const std::string what = describe_batch("all_gather", ops, tag);
  run(what, [&](cudaStream_t stream) {
    check(ncclGroupStart(), "ncclGroupStart");
    for (const auto& op : ops)
      check(ncclAllGather(op.input.data_ptr(), op.output.data_ptr(), op.input.numel(),
                          nccl_type(op.input.scalar_type()), comm_, stream),
            "all_gather");
    check(ncclGroupEnd(), what);
  });
}

void NcclCommunicator::do_reduce_scatter(const std::vector<Buffers>& ops, ReduceOp op, const std::string& tag) {
  for (const auto& s : ops) {
    check_device(s.input, "reduce_scatter");
    check_device(s.output, "reduce_scatter");
  }
  const std::string what = describe_batch(reducing("reduce_scatter", op), ops, tag);
  run(what, [&](cudaStream_t stream) {
    check(ncclGroupStart(), "ncclGroupStart");
    for (const auto& s : ops)
      check(ncclReduceScatter(s.input.data_ptr(), s.output.data_ptr(), s.output.numel(),
                              nccl_type(s.input.scalar_type()), nccl_op(op), comm_, stream),
            "reduce_scatter");
    check(ncclGroupEnd(), what);
  });
}

void NcclCommunicator::do_all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_device(tensor, "all_reduce");
  run(reducing("all_reduce", op) + " of " + bytes_of(tensor), [&](cudaStream_t stream) {
    check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                        nccl_type(tensor.scalar_type()), nccl_op(op), comm_, stream),
          "all_reduce");
  });
}

void NcclCommunicator::do_broadcast(const at::Tensor& tensor, int root) {
  check_device(tensor, "broadcast");
  run("broadcast of " + bytes_of(tensor) + " from rank " + std::to_string(root),
      [&](cudaStream_t stream) {
        check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                            nccl_type(tensor.scalar_type()), root, comm_, stream),
              "broadcast");
      });
}

// A barrier blocks the CPU: all-reduce one element, then wait for it (the
// watchdog ends the process if a peer never arrives).
void NcclCommunicator::do_barrier() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  at::Tensor token = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
  do_all_reduce(token, ReduceOp::Sum);
  check_cuda(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(device_).stream()), "barrier");
}

}  // namespace fsdp
