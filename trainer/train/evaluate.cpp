#include "train/evaluate.h"

#include <torch/nn/functional/loss.h>

#include <ATen/ops/stack.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>

#include "fsdp/fully_shard.h"

namespace fsdp::train {

EvalResult evaluate(model::Llama& model, Communicator& comm, const DataRank& me, const TokenSource& data,
                    int64_t rows, int64_t batch) {
  c10::NoGradGuard no_grad;
  const int64_t per_pass = batch * me.count;
  const int64_t passes = (rows + per_pass - 1) / per_pass;
  const auto on_device = at::TensorOptions().dtype(at::kDouble).device(comm.device());
  at::Tensor loss_sum = at::zeros({}, on_device), counted = at::zeros({}, on_device);
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t first = pass * per_pass + me.index * batch;
    const int64_t inside = me.counts ? std::clamp<int64_t>(rows - first, 0, batch) : 0;
    // Every rank runs the forward (its all-gathers are collectives), counted rows or not.
    auto tokens = data.samples(first, batch).to(comm.device());
    const int64_t seq = tokens.size(1) - 1;
    auto logits = fsdp::forward(model, tokens.narrow(1, 0, seq));
    if (inside == 0) continue;
    // Summed in float64: the total depends on the rows, not on how ranks split them.
    auto losses = torch::nn::functional::cross_entropy(
        logits.narrow(0, 0, inside).reshape({-1, logits.size(-1)}).to(at::kDouble),
        tokens.narrow(0, 0, inside).narrow(1, 1, seq).reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    loss_sum += losses;
    counted += static_cast<double>(inside * seq);
  }
  at::Tensor totals = at::stack({loss_sum, counted});
  comm.all_reduce(totals, ReduceOp::Sum);
  totals = totals.cpu();
  EvalResult result;
  result.tokens = static_cast<int64_t>(totals[1].item<double>());
  result.loss = totals[0].item<double>() / static_cast<double>(result.tokens);
  result.perplexity = std::exp(result.loss);
  return result;
}

}  // namespace fsdp::train
