// Failure scenarios run by ctest: each must end with a clear error, not hang.
//   fault_program SCENARIO [mpi|nccl]
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include "fsdp/fsdp.h"

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  try {
    fsdp::InitOptions options;
    const bool nccl = argc > 2 && std::string(argv[2]) == "nccl";
    options.backend = nccl ? fsdp::Backend::Nccl : fsdp::Backend::Mpi;
    options.timeout = std::chrono::seconds(2);
    auto comm = fsdp::init(options);
    if (scenario == "peer-hangs" || scenario == "peer-exits") {
      if (comm->rank() == 1) {
        if (scenario == "peer-exits") _exit(0);
        std::this_thread::sleep_for(std::chrono::seconds(30));
        return 0;
      }
      at::Tensor t = at::ones({1}, at::TensorOptions().device(comm->device()));
      comm->all_reduce(t, fsdp::ReduceOp::Sum);
      t.cpu();   // NCCL is asynchronous: wait here, as a training step would
      return 0;  // not reached: rank 1 never joins
    }
    if (scenario == "swapped-order") {
      // Equal-sized all-gathers of different things in a different order on
      // each rank: without the check they would pair up and swap data.
      comm->set_check_collectives(true);
      at::Tensor in = at::ones({4}, at::TensorOptions().device(comm->device()));
      at::Tensor out = at::empty({4 * comm->world_size()}, in.options());
      const bool first = comm->rank() == 0;
      comm->all_gather_coalesced({out}, {in}, first ? "#1 Block" : "#2 Block");
      comm->all_gather_coalesced({out}, {in}, first ? "#2 Block" : "#1 Block");
      return 0;  // not reached: the check throws on every rank
    }
    if (scenario == "init-mpi") return 0;
    fsdp::abort_job("fault_program: unknown scenario '" + scenario + "'");
  } catch (const std::exception& e) {
    fsdp::abort_job(std::string("fault_program: ") + e.what());
  }
}
