// A GPT-2-style language model trained with fsdp.cpp: learned position embeddings, pre-LayerNorm
// blocks with a fused QKV projection, causal SDPA and a GELU MLP. Each block is its own sharded
// group and is recomputed in backward (fsdp::recompute); the root (embeddings, final LayerNorm,
// head) is sharded last. On GPUs the blocks run in bf16 with fp32 gradient reduction.
// Synthetic data: each sequence follows a fixed random successor table from a random start, so
// the next token is predictable and the loss falls from ln(vocab).
//   mpirun -n 2 ./gpt2
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"

struct Config {
  int64_t vocab = 96, positions = 32, dim = 64, heads = 4, layers = 4;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const Config& c) : heads(c.heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    qkv = register_module("qkv", torch::nn::Linear(c.dim, 3 * c.dim));
    proj = register_module("proj", torch::nn::Linear(c.dim, c.dim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    fc = register_module("fc", torch::nn::Linear(c.dim, 4 * c.dim));
    out = register_module("out", torch::nn::Linear(4 * c.dim, c.dim));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t batch = x.size(0), seq = x.size(1), dim = x.size(2);
    // [3, batch, heads, seq, head_dim]: q, k and v from one matrix product.
    auto qkv_heads = qkv(ln1(x)).view({batch, seq, 3, heads, dim / heads}).permute({2, 0, 3, 1, 4});
    auto attended = at::scaled_dot_product_attention(qkv_heads[0], qkv_heads[1], qkv_heads[2], {}, 0.0,
                                                     /*is_causal=*/true);
    x = x + proj(attended.transpose(1, 2).reshape({batch, seq, dim}));
    return x + out(torch::gelu(fc(ln2(x)), "tanh"));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const Config& c) {
    tokens = register_module("tokens", torch::nn::Embedding(c.vocab, c.dim));
    positions = register_module("positions", torch::nn::Embedding(c.positions, c.dim));
    for (int64_t i = 0; i < c.layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(c)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto where = torch::arange(idx.size(1), idx.options());
    auto x = tokens(idx) + positions(where);
    for (auto& block : blocks) x = fsdp::recompute(block, x);  // activations recomputed in backward
    return head(ln_f(x));
  }
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Gpt);

int main() {
  auto comm = fsdp::init();
  const int rank = comm->rank(), ranks = comm->world_size();
  const Config config;
  const int64_t rows_per_rank = 16, steps = 60;

  torch::manual_seed(0);
  Gpt model(config);
  model->to(comm->device());
  fsdp::ShardOptions options;
  if (comm->device().is_cuda()) {
    options.mixed_precision.param_dtype = torch::kBFloat16;
    options.mixed_precision.reduce_dtype = torch::kFloat;
  }
  for (auto& block : model->blocks) fsdp::fully_shard(block, options);
  fsdp::fully_shard(model, options);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));

  const torch::Tensor successor = torch::randperm(config.vocab);  // the language: token t is followed by successor[t]
  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    torch::manual_seed(1000 + step);  // the step's global batch, the same on every rank
    torch::Tensor seq = torch::empty({rows_per_rank * ranks, config.positions + 1}, torch::kLong);
    seq.select(1, 0).copy_(torch::randint(config.vocab, {seq.size(0)}));
    for (int64_t t = 1; t < seq.size(1); ++t) seq.select(1, t).copy_(successor.index_select(0, seq.select(1, t - 1)));
    seq = seq.narrow(0, rank * rows_per_rank, rows_per_rank).to(comm->device());  // this rank's rows

    optimizer.zero_grad();
    auto logits = fsdp::forward(model, seq.narrow(1, 0, config.positions));
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}).to(torch::kFloat),
                                                     seq.narrow(1, 1, config.positions).reshape({-1}));
    loss.backward();
    fsdp::clip_grad_norm_(*model, 1.0);
    optimizer.step();

    torch::Tensor mean = loss.detach().clone();
    comm->all_reduce(mean, fsdp::ReduceOp::Avg);
    last = mean.item<double>();
    if (step == 0) first = last;
    if (rank == 0 && (step % 20 == 0 || step == steps - 1))
      std::printf("step %3lld | loss %.4f\n", static_cast<long long>(step + 1), last);
  }
  const bool learned = last < first / 4;
  if (rank == 0)
    std::printf("gpt2 (fsdp.cpp %s, %d rank(s)): loss %s from %.4f (ln %lld = %.4f) to %.4f\n", fsdp::version(), ranks,
                learned ? "fell" : "did not fall enough", first, static_cast<long long>(config.vocab),
                std::log(static_cast<double>(config.vocab)), last);
  return learned ? 0 : 1;
}
