// The smallest fsdp.cpp program: an MLP fitted to a synthetic regression target, sharded over the
// processes mpirun (CPU) or torchrun (one per GPU) started. Every rank builds the same model from
// the same seed, shards it, and trains on its own rows of each step's batch.
//   mpirun -n 2 ./mlp
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t inputs, int64_t hidden, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), torch::nn::Linear(i ? hidden : inputs, hidden)));
    head = register_module("head", torch::nn::Linear(hidden, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : blocks) x = torch::gelu(fsdp::forward(block, x));  // gathers, runs, frees the block
    return head(x);  // the root's own parameters are gathered for the whole forward
  }
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Mlp);

int main() {
  auto comm = fsdp::init();  // MPI on CPU, NCCL on GPUs, from the launcher's variables
  const int rank = comm->rank(), ranks = comm->world_size();
  const int64_t inputs = 16, rows_per_rank = 64, steps = 200;

  torch::manual_seed(0);  // the same initial weights on every rank
  Mlp model(inputs, 128, 4);
  model->to(comm->device());
  for (auto& block : model->blocks) fsdp::fully_shard(block);  // each block its own group
  fsdp::fully_shard(model);                                     // the root last: the head
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));

  const torch::Tensor w = torch::randn({inputs, 1}) / 4;  // the target: y = sin(x w) + x_0 x_1
  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    torch::manual_seed(1000 + step);  // the step's global batch, the same on every rank
    torch::Tensor x = torch::randn({rows_per_rank * ranks, inputs});
    torch::Tensor y = torch::sin(x.matmul(w)) + x.select(1, 0).unsqueeze(1) * x.select(1, 1).unsqueeze(1);
    x = x.narrow(0, rank * rows_per_rank, rows_per_rank).to(comm->device());  // this rank's rows
    y = y.narrow(0, rank * rows_per_rank, rows_per_rank).to(comm->device());

    optimizer.zero_grad();
    torch::Tensor loss = torch::mse_loss(fsdp::forward(model, x), y);
    loss.backward();  // reduce-scatters each block's gradients as its backward ends
    optimizer.step();  // on this rank's shards

    torch::Tensor mean = loss.detach().clone();
    comm->all_reduce(mean, fsdp::ReduceOp::Avg);
    last = mean.item<double>();
    if (step == 0) first = last;
    if (rank == 0 && (step % 40 == 0 || step == steps - 1))
      std::printf("step %3lld | loss %.4f\n", static_cast<long long>(step + 1), last);
  }
  const bool learned = last < first / 4;
  if (rank == 0)
    std::printf("mlp (fsdp.cpp %s, %d rank(s)): loss %s from %.4f to %.4f\n", fsdp::version(), ranks,
                learned ? "fell" : "did not fall enough", first, last);
  return learned ? 0 : 1;
}
