// CPU collectives through OpenMPI. Non-blocking MPI calls polled against a
// deadline, so a collective whose peers never arrive raises CollectiveError
// naming the rank, communicator and operation instead of hanging.
#pragma once

#include <mpi.h>

#include "comm/backend_hooks.h"

namespace fsdp {

// Initialises MPI once per process (thread level MULTIPLE when available).
void ensure_mpi_initialized();
bool mpi_is_initialized();

class MpiCommunicator : public Communicator {
 public:
  // A communicator over every process mpirun started (a duplicate of MPI_COMM_WORLD).
  MpiCommunicator(std::string name, std::chrono::milliseconds timeout);
  ~MpiCommunicator() override;

  const char* backend() const override { return "mpi"; }
  at::Device device() const override { return at::kCPU; }

 protected:
  FSDP_COMMUNICATOR_BACKEND_HOOKS

 private:
  // Takes ownership of `comm`.
  MpiCommunicator(MPI_Comm comm, std::string name, std::chrono::milliseconds timeout);
  // Polls the requests until all complete or the timeout passes.
  void wait(std::vector<MPI_Request>& requests, const std::string& what);

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool timed_out_ = false;  // a stuck request may still reference comm_: never free it then
};

}  // namespace fsdp
