// CPU collectives through OpenMPI. Non-blocking MPI calls polled against a
// deadline, so a collective whose peers never arrive raises CollectiveError
// naming the rank, group and operation instead of hanging.
#pragma once

#include <mpi.h>

#include "fsdp/communicator.h"

namespace fsdp {

// Initialises MPI once per process (thread level MULTIPLE when available).
void ensure_mpi_initialized();
bool mpi_is_initialized();

class MpiCommunicator : public Communicator {
 public:
  // A communicator over every process mpirun started (a duplicate of MPI_COMM_WORLD).
  MpiCommunicator(std::string group_name, std::chrono::milliseconds timeout);
  ~MpiCommunicator() override;

  const char* backend() const override { return "mpi"; }
  at::Device device() const override { return at::kCPU; }

 protected:
  void do_all_gather(const std::vector<Buffers>& ops, const std::string& tag) override;
  void do_reduce_scatter(const std::vector<Buffers>& ops, ReduceOp op, const std::string& tag) override;
  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override;
  void do_broadcast(const at::Tensor& tensor, int root) override;
  void do_barrier() override;
  std::shared_ptr<Communicator> do_split(int color, int key, std::string group_name) override;

 private:
  // Takes ownership of `comm`.
  MpiCommunicator(MPI_Comm comm, std::string group_name, std::chrono::milliseconds timeout);
  // Polls the requests until all complete or the timeout passes.
  void wait(std::vector<MPI_Request>& requests, const std::string& what);

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool timed_out_ = false;  // a stuck request may still reference comm_: never free it then
};

}  // namespace fsdp
