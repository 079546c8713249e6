#include "comm/process_group_communicator.h"

#include <stdexcept>
#include <utility>

#include "comm/tensor_alias.h"

namespace fsdp {

// Gloo's work holds alias_without_view()s of the caller's tensors: its worker thread drops its
// references after the wait has returned, under the process group's lock, and a drop that reaches
// a Python object (through an autograd view of a tensor Python owns) needs the GIL, which the
// thread issuing the next collective holds while it waits: that collective would never run.

ProcessGroupCommunicator::ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                   std::string name, std::chrono::milliseconds timeout)
    : Communicator(group->getRank(), group->getSize(), std::move(name), timeout), group_(std::move(group)) {}

void ProcessGroupCommunicator::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  bool done = false;
  try {
    done = work->wait(timeout());
  } catch (const std::exception& e) {
    const std::string message = e.what();
    if (message.find("imed out") != std::string::npos || message.find("imeout") != std::string::npos)
      throw CollectiveError(timeout_message(what));
    throw CollectiveError("fsdp: " + what + " on " + describe() + " failed: " + message);
  }
  if (!done) throw CollectiveError(timeout_message(what));
}

// One piece at a time, each waited for before the next is issued (ranks through gloo are for jobs
// without mpirun, not for speed).
void ProcessGroupCommunicator::do_all_gather(const std::vector<Buffers>& ops, const std::string& tag) {
  const std::string what = describe_batch("all_gather", ops, tag);
  for (const Buffers& op : ops) {
    at::Tensor output = alias_without_view(op.output), input = alias_without_view(op.input);
    wait(group_->_allgather_base(output, input), what);
  }
}

// Gloo reduces by sum only: an average is the sum divided by the ranks.
void ProcessGroupCommunicator::do_reduce_scatter(const std::vector<Buffers>& ops, ReduceOp op, const std::string& tag) {
  const std::string what = describe_batch("reduce_scatter", ops, tag);
  for (const Buffers& b : ops) {
    at::Tensor output = alias_without_view(b.output), input = alias_without_view(b.input);
    wait(group_->_reduce_scatter_base(output, input), what);
    if (op == ReduceOp::Avg) output.div_(world_size());
  }
}

void ProcessGroupCommunicator::do_all_reduce(const at::Tensor& tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors{alias_without_view(tensor)};
  wait(group_->allreduce(tensors), "all_reduce of " + bytes_of(tensor));
  if (op == ReduceOp::Avg) tensor.div_(world_size());
}

void ProcessGroupCommunicator::do_broadcast(const at::Tensor& tensor, int root) {
  std::vector<at::Tensor> tensors{alias_without_view(tensor)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  wait(group_->broadcast(tensors, options), "broadcast of " + bytes_of(tensor));
}

void ProcessGroupCommunicator::do_barrier() { wait(group_->barrier(), "barrier"); }

std::shared_ptr<Communicator> ProcessGroupCommunicator::do_split(int, int, std::string) {
  throw std::invalid_argument(
      "fsdp: the ranks joined through a torch process group (" + describe() +
      ") cannot be split into the groups of a mesh (HSDP): launch CPU ranks with mpirun (`fsdp-run -n N`) or "
      "run on GPUs (NCCL)");
}

}  // namespace fsdp
