// CPU collectives through a torch.distributed process group the program already made (torch's
// Gloo, built into libtorch): how the Python front end's CPU ranks meet under torchrun, where
// there is no mpirun. Each collective is waited for within the timeout before the next is issued.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "fsdp/communicator.h"

namespace fsdp {

class ProcessGroupCommunicator : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string group_name,
                           std::chrono::milliseconds timeout);

  const char* backend() const override { return "gloo"; }
  at::Device device() const override { return at::kCPU; }

 protected:
  void do_all_gather(const std::vector<Buffers>& ops, const std::string& tag) override;
  void do_reduce_scatter(const std::vector<Buffers>& ops, ReduceOp op, const std::string& tag) override;
  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override;
  void do_broadcast(const at::Tensor& tensor, int root) override;
  void do_barrier() override;
  std::shared_ptr<Communicator> do_split(int color, int key, std::string group_name) override;

 private:
  // Waits for `work` within the timeout; a failure or a timeout raises CollectiveError naming `what`.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

}  // namespace fsdp
