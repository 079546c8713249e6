// CPU collectives through a torch.distributed process group the program already made (torch's
// Gloo, built into libtorch): how the Python front end's CPU ranks meet under torchrun, where
// there is no mpirun. Each collective is waited for within the timeout before the next is issued.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/backend_hooks.h"

namespace fsdp {

class ProcessGroupCommunicator : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string name,
                           std::chrono::milliseconds timeout);

  const char* backend() const override { return "gloo"; }
  at::Device device() const override { return at::kCPU; }

 protected:
  FSDP_COMMUNICATOR_BACKEND_HOOKS

 private:
  // Waits for `work` within the timeout; a failure or a timeout raises CollectiveError naming `what`.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

}  // namespace fsdp
