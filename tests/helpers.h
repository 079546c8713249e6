// Shared pieces of the multi-rank tests: small models and a training loop that
// runs either sharded (each rank its rows of the global batch) or as the
// single-process reference (all rows, no communication).
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "model/llama.h"
#include "train/data.h"

namespace fsdp::testing {

inline std::shared_ptr<Communicator> world() { return default_communicator(); }
// The tests run on the communicator's device: cpu under MPI, a GPU under NCCL.
inline at::Device device() { return world()->device(); }
inline at::TensorOptions on_device(at::ScalarType dtype = at::kFloat) {
  return at::TensorOptions().dtype(dtype).device(device());
}

inline model::LlamaConfig tiny_llama() {
  model::LlamaConfig c;
  c.vocab = 64, c.dim = 32, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.ffn = 48;
  c.max_seq = 32;
  return c;
}

// A model with the awkward cases: a layer whose inputs need no gradient, a
// frozen layer, a 1-row weight and bias (fewer rows than ranks), a 0-dim
// parameter and a layer that is never used.
class ToyNetImpl : public torch::nn::Module {
 public:
  ToyNetImpl() {
    first = register_module("first", torch::nn::Linear(7, 10));
    frozen = register_module("frozen", torch::nn::Linear(torch::nn::LinearOptions(10, 10).bias(false)));
    last = register_module("last", torch::nn::Linear(10, 1));
    unused = register_module("unused", torch::nn::Linear(3, 3));
    scale = register_parameter("scale", torch::tensor(1.5));
    frozen->weight.requires_grad_(false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(fsdp::forward(first, x));
    h = h + fsdp::forward(frozen, h);
    return fsdp::forward(last, h) * scale;
  }
  torch::nn::Linear first{nullptr}, frozen{nullptr}, last{nullptr}, unused{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(ToyNet);

struct TrainResult {
  std::vector<double> losses;       // global mean loss per step
  std::vector<double> grad_norms;   // before clipping, when clipping
  std::vector<std::pair<std::string, at::Tensor>> params;  // full values after training
  std::vector<std::string> params_without_grad;            // after the last backward
};

struct TrainSetup {
  std::shared_ptr<torch::nn::Module> module;
  // Loss of the model on rows [first, first + count) of step's global batch.
  std::function<at::Tensor(int64_t step, int64_t first, int64_t count)> loss;
  std::function<void()> shard;  // empty: single-process reference
  int steps = 4;
  int64_t rows_per_rank = 2;
  double clip = 0;  // 0: no clipping
  bool optimizer_before_shard = false;
  bool sgd = false;  // plain SGD (lr 0.1) instead of AdamW
  int micro_batches = 1;  // gradient accumulation: backward per slice, one step
};

inline TrainResult train(const TrainSetup& s) {
  const bool sharded = static_cast<bool>(s.shard);
  const int world_size = world()->world_size(), rank = world()->rank();
  auto make_optimizer = [&]() -> std::unique_ptr<torch::optim::Optimizer> {
    if (s.sgd) return std::make_unique<torch::optim::SGD>(s.module->parameters(), torch::optim::SGDOptions(0.1));
    return std::make_unique<torch::optim::AdamW>(
        s.module->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  };
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (s.optimizer_before_shard) optimizer = make_optimizer();
  if (sharded) s.shard();
  if (!optimizer) optimizer = make_optimizer();

  TrainResult result;
  for (int step = 0; step < s.steps; ++step) {
    optimizer->zero_grad();
    const int64_t rows = sharded ? s.rows_per_rank : s.rows_per_rank * world_size;
    const int64_t first = sharded ? rank * s.rows_per_rank : 0;
    const int64_t slice = rows / s.micro_batches;
    at::Tensor loss = torch::zeros({}, on_device());
    for (int m = 0; m < s.micro_batches; ++m) {
      at::Tensor part = s.loss(step, first + m * slice, slice) / s.micro_batches;
      part.backward();
      loss += part.detach();
    }
    if (s.clip > 0) {
      if (sharded) {
        result.grad_norms.push_back(clip_grad_norm_(*s.module, s.clip).item<double>());
      } else {
        result.grad_norms.push_back(
            torch::nn::utils::clip_grad_norm_(s.module->parameters(), s.clip));
      }
    }
    optimizer->step();
    at::Tensor global = loss.detach().clone();
    if (sharded) world()->all_reduce(global, ReduceOp::Avg);
    result.losses.push_back(global.item<double>());
  }
  for (const auto& item : s.module->named_parameters())
    if (!item.value().grad().defined()) result.params_without_grad.push_back(item.key());
  if (sharded) {
    result.params = full_state_dict(*s.module);
  } else {
    for (const auto& item : s.module->named_parameters())
      result.params.emplace_back(item.key(), item.value().detach().clone());
    for (const auto& item : s.module->named_buffers())
      result.params.emplace_back(item.key(), item.value().detach().clone());
  }
  return result;
}

inline TrainSetup llama_setup(model::Llama llama, std::function<void(model::Llama&)> shard = {}) {
  TrainSetup s;
  s.module = llama.ptr();
  auto data = std::shared_ptr<train::TokenSource>(train::synthetic_tokens(llama->config.vocab, 99));
  s.loss = [llama, data](int64_t, int64_t first, int64_t count) mutable {
    const int64_t seq = 16;
    // The same batch every step, so the loss must fall steadily.
    auto tokens = data->rows(0, first, count, seq).to(device());
    auto logits = fsdp::forward(llama, tokens.narrow(1, 0, seq));
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, llama->config.vocab}).to(torch::kFloat),
        tokens.narrow(1, 1, seq).reshape({-1}));
  };
  if (shard) s.shard = [llama, shard]() mutable { shard(llama); };
  return s;
}

inline model::Llama seeded_llama(const model::LlamaConfig& c, uint64_t seed = 5) {
  torch::manual_seed(seed);
  model::Llama m(c);
  m->to(device());
  return m;
}

inline void shard_blocks_and_root(model::Llama& m, const ShardOptions& o = {}) {
  for (auto& b : m->blocks) fully_shard(b, o);
  fully_shard(m, o);
}

// fp32 runs differ from the reference only in the order gradients are
// summed (per-rank partial means, then the reduce-scatter average): about
// 1e-7 relative. SGD passes that straight through (parameter differences
// ~1e-9). AdamW divides every element by its own running magnitude, so an
// element with a near-zero gradient turns a tiny difference into up to
// lr * dg / eps, and later steps compound it: over 4 steps at lr 1e-2 we
// measured up to 1.6e-5 on 3 ranks. Real bugs (a wrong shard, a lost or
// doubled gradient) move parameters by about lr = 1e-2, so AdamW runs are
// checked at 1e-4 and SGD runs, which also catch gradient-scale errors that
// AdamW's normalisation hides, at 1e-6.
constexpr double kAdamTolerance = 1e-4;
constexpr double kSgdTolerance = 1e-6;

inline void expect_same_run(const TrainResult& got, const TrainResult& want,
                            double tolerance = kAdamTolerance) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], want.losses[i], tolerance * std::max(1.0, std::abs(want.losses[i])))
        << "loss of step " << i;
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    EXPECT_EQ(got.params[i].first, want.params[i].first);
    ASSERT_EQ(got.params[i].second.sizes(), want.params[i].second.sizes()) << got.params[i].first;
    const double diff = (got.params[i].second - want.params[i].second).abs().max().item<double>();
    EXPECT_LE(diff, tolerance) << got.params[i].first;
    if (std::getenv("FSDP_TEST_SHOW_DIFF")) std::printf("%s max diff %.3g\n", got.params[i].first.c_str(), diff);
  }
  EXPECT_EQ(got.params_without_grad, want.params_without_grad);
}

inline void expect_identical_run(const TrainResult& a, const TrainResult& b) {
  EXPECT_EQ(a.losses, b.losses);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(torch::equal(a.params[i].second, b.params[i].second)) << a.params[i].first;
}

}  // namespace fsdp::testing
