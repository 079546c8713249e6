// The hooks every Communicator backend overrides (communicator.h, "Backends implement batches"),
// declared by one line in each backend's class so that the list is written once.
#pragma once

#include "fsdp/communicator.h"

#define FSDP_COMMUNICATOR_BACKEND_HOOKS                                                                        \
  void do_all_gather(const std::vector<Buffers>& ops, const std::string& tag) override;                        \
  void do_reduce_scatter(const std::vector<Buffers>& ops, ReduceOp op, const std::string& tag) override;       \
  void do_all_reduce(const at::Tensor& tensor, ReduceOp op) override;                                          \
  void do_broadcast(const at::Tensor& tensor, int root) override;                                              \
  void do_barrier() override;                                                                                  \
  std::shared_ptr<Communicator> do_split(int color, int key, std::string name) override;
