#include "comm/mpi_communicator.h"

#include <ATen/ops/empty.h>

#include <cstdlib>
#include <thread>

#include "comm/collective_names.h"

namespace fsdp {
namespace {

bool g_failed_collective = false;  // set on timeout: MPI_Finalize could then hang

void finalize_mpi_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !g_failed_collective) MPI_Finalize();
}

// MPI has no bfloat16/half type: they travel as raw 16-bit words and are
// reduced in float32 (see reduced_in_float).
MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kChar: return MPI_INT8_T;
    case at::kBool: return MPI_C_BOOL;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;
    default: throw CollectiveError(std::string("fsdp: the MPI backend does not support dtype ") +
                                   c10::toString(t));
  }
}

bool needs_float_reduction(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

}  // namespace

bool mpi_is_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

void ensure_mpi_initialized() {
  if (mpi_is_initialized()) return;
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  // Autograd may run our hooks on another thread than the one that called
  // forward; we never call MPI from two threads at once, so SERIALIZED suffices.
  if (provided < MPI_THREAD_SERIALIZED)
    throw CollectiveError("fsdp: MPI provides thread level " + std::to_string(provided) +
                          ", fsdp.cpp needs MPI_THREAD_SERIALIZED or better");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  std::atexit(finalize_mpi_at_exit);
}

namespace {
MPI_Comm duplicate_world() {
  ensure_mpi_initialized();
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  return comm;
}
int rank_in(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}
int size_of(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  return size;
}
}  // namespace

MpiCommunicator::MpiCommunicator(std::string name, std::chrono::milliseconds timeout)
    : MpiCommunicator(duplicate_world(), std::move(name), timeout) {}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, std::chrono::milliseconds timeout)
    : Communicator(rank_in(comm), size_of(comm), std::move(name), timeout), comm_(comm) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
}

std::shared_ptr<Communicator> MpiCommunicator::do_split(int color, int key, std::string name) {
  MPI_Comm part = MPI_COMM_NULL;
  const int rc = MPI_Comm_split(comm_, color, key, &part);
  if (rc != MPI_SUCCESS || part == MPI_COMM_NULL)
    throw CollectiveError("fsdp: MPI_Comm_split of " + describe() + " into '" + name + "' failed");
  return std::shared_ptr<Communicator>(new MpiCommunicator(part, std::move(name), timeout()));
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !timed_out_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::wait(std::vector<MPI_Request>& requests, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout();
  for (int polls = 0;; ++polls) {
    int done = 0;
    int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                         MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) {
      char msg[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(rc, msg, &len);
      throw CollectiveError("fsdp: " + what + " failed on " + describe() + ": " + std::string(msg, len) +
                            "; the ranks may have called different collectives" + mismatch_hint());
    }
    if (done) return;
    if (std::chrono::steady_clock::now() > deadline) {
      timed_out_ = true;
      g_failed_collective = true;
      throw CollectiveError(timeout_message(what));
    }
    // Spin briefly for latency, then back off so idle ranks leave the CPU to busy ones.
    if (polls > 200) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void MpiCommunicator::do_all_gather(const std::vector<Buffers>& ops, const std::string& tag) {
  std::vector<MPI_Request> requests(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    MPI_Iallgather(op.input.data_ptr(), static_cast<int>(op.input.numel()),
                   mpi_type(op.input.scalar_type()), op.output.data_ptr(),
                   static_cast<int>(op.input.numel()), mpi_type(op.input.scalar_type()), comm_,
                   &requests[i]);
  }
  wait(requests, describe_batch("all_gather", ops, tag));
}

void MpiCommunicator::do_reduce_scatter(const std::vector<Buffers>& ops, ReduceOp op, const std::string& tag) {
  // MPI reads `in` and writes `out`; for 16-bit floats these are float32
  // copies, and `out` goes back into `result` once the requests complete.
  struct Pending {
    at::Tensor in, out, result;
  };
  std::vector<Pending> pending;
  std::vector<MPI_Request> requests(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    Pending p{ops[i].input, ops[i].output, ops[i].output};
    if (needs_float_reduction(p.in.scalar_type())) {
      p.in = p.in.to(at::kFloat);
      p.out = at::empty(p.result.sizes(), p.in.options());
    }
    MPI_Ireduce_scatter_block(p.in.data_ptr(), p.out.data_ptr(), static_cast<int>(p.out.numel()),
                              mpi_type(p.in.scalar_type()), MPI_SUM, comm_, &requests[i]);
    pending.push_back(std::move(p));
  }
  wait(requests, describe_batch(reducing("reduce_scatter", op), ops, tag));
  for (auto& p : pending) {
    if (op == ReduceOp::Avg) p.out.div_(world_size());
    if (p.out.data_ptr() != p.result.data_ptr()) p.result.copy_(p.out);
  }
}

void MpiCommunicator::do_all_reduce(const at::Tensor& tensor, ReduceOp op) {
  at::Tensor buf = needs_float_reduction(tensor.scalar_type()) ? tensor.to(at::kFloat) : tensor;
  std::vector<MPI_Request> requests(1);
  MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), static_cast<int>(buf.numel()),
                 mpi_type(buf.scalar_type()), MPI_SUM, comm_, &requests[0]);
  wait(requests, reducing("all_reduce", op) + " of " + bytes_of(tensor));
  if (op == ReduceOp::Avg) buf.div_(world_size());
  if (buf.data_ptr() != tensor.data_ptr()) tensor.copy_(buf);
}

void MpiCommunicator::do_broadcast(const at::Tensor& tensor, int root) {
  std::vector<MPI_Request> requests(1);
  MPI_Ibcast(tensor.data_ptr(), static_cast<int>(tensor.numel()), mpi_type(tensor.scalar_type()),
             root, comm_, &requests[0]);
  wait(requests, "broadcast of " + bytes_of(tensor) + " from rank " + std::to_string(root));
}

void MpiCommunicator::do_barrier() {
  std::vector<MPI_Request> requests(1);
  MPI_Ibarrier(comm_, &requests[0]);
  wait(requests, "barrier");
}

}  // namespace fsdp
