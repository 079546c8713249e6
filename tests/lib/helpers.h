// Shared pieces of the multi-rank tests: small models and a training loop that
// runs either sharded (each rank its rows of the global batch) or as the
// single-process reference (all rows, no communication).
#pragma once

#include <gmock/gmock.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "fsdp/planning.h"
#include "test_llama.h"

namespace fsdp::testing {

inline std::shared_ptr<Communicator> world() { return default_communicator(); }
// The tests run on the communicator's device: cpu under MPI, a GPU under NCCL.
inline at::Device device() { return world()->device(); }
inline at::TensorOptions on_device(at::ScalarType dtype = at::kFloat) {
  return at::TensorOptions().dtype(dtype).device(device());
}
// One directory for all ranks of this run (under gtest's temporary directory): rank 0's pid, broadcast.
inline std::string shared_dir(const std::string& name) {
  at::Tensor pid = torch::tensor({static_cast<int64_t>(getpid())}, on_device(at::kLong));
  world()->broadcast(pid, 0);
  return ::testing::TempDir() + "fsdp_ckpt_" + std::to_string(pid.item<int64_t>()) + "_" + name;
}

inline TestLlamaConfig tiny_llama() { return TestLlamaConfig{}; }

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

// Tolerances from float32 arithmetic, not from one machine.
//
// A sharded run and its single-process reference add the same terms in other orders: each rank
// averages its own rows, the reduce-scatter averages the ranks, and the CPU's matrix kernels block
// their sums by the row count and by the vector width of the machine (ATEN_CPU_CAPABILITY, thread
// count). A sum of K terms then differs between two orders by up to 2*K*u times the sum of the
// terms' magnitudes (u = 2^-24, the float32 unit roundoff), but rounding errors behave like
// independent random variables, and with probability above 1 - 1e-21 the difference stays under
// 2 * lambda * sqrt(K) * u with lambda = 10 (Higham & Mary, "A new approach to probabilistic rounding
// error analysis", SISC 2019). A loss or gradient comes out of a chain of D such sums (forward and
// backward through each layer), whose errors add the same way, so one step's loss, gradient
// norm and gradients agree to the relative error
//     eps = 2 * lambda * sqrt(D * K) * u,
// K the longest sum (the tokens of the global batch, or a hidden or vocabulary dimension), the
// gradients' scale taken as the step's largest |gradient|. Step t (from 0) inherits the earlier
// steps' differences through the parameters: (t + 1) * eps.
//   SGD moves a parameter by lr * g: the parameters differ by at most the sum over steps of
//   lr * (t + 1) * eps * max|g_t|.
//   AdamW divides each gradient by its own running magnitude, sqrt(v) + adam_eps: near a zero
//   gradient any rounding difference becomes an update difference of up to 2 * lr, whatever the
//   precision, so with PyTorch's adam_eps = 1e-8 no bound below the size of a real bug exists. The
//   parity runs use adam_eps = kParityAdamEps, the tiny models' typical gradient size, where the
//   update m/(sqrt(v) + adam_eps) changes by at most (1 + R_t) * delta / adam_eps for gradients
//   that all move by delta (m and sqrt(v) are a weighted mean and a weighted RMS of the gradients,
//   each moving by at most delta; R_t bounds |m|/sqrt(v) by Cauchy-Schwarz over the weights).
// Clipping scales the gradients by clip / norm, whose own error doubles delta.
// Real bugs (a wrong shard, a lost rank, a doubled gradient) move the parameters by a sizeable
// part of a step; Parity.TolerancesCatchASmallError checks that an error of 1% of the
// learning rate already exceeds these bounds. Where both sides run the same arithmetic by
// construction (prefetch, caps, buckets, optimizer order), runs must be bit-identical instead.
constexpr double kUnitRoundoff = 0x1p-24;
constexpr double kRoundingLambda = 10;
constexpr double kParityAdamEps = 1e-2;
constexpr double kParityAdamLr = 1e-2, kParitySgdLr = 0.1;

struct Rounding {
  int chain_depth = 1;      // D: sums a loss or gradient passes through
  int64_t longest_sum = 1;  // K, at this world size
  double eps() const {
    return 2 * kRoundingLambda * std::sqrt(static_cast<double>(chain_depth) * longest_sum) * kUnitRoundoff;
  }
};

struct Bounds {
  std::vector<double> relative;  // per step: losses and gradient norms
  double parameters = 0;         // absolute, after the last step
};

struct TrainResult {
  std::vector<double> losses;       // global mean loss per step
  std::vector<double> grad_norms;   // before clipping, when clipping
  std::vector<std::pair<std::string, at::Tensor>> params;  // full values after training
  std::vector<std::string> params_without_grad;            // after the last backward
  Bounds bounds;                    // single-process reference: how far a sharded run may be
};

struct TrainSetup {
  std::shared_ptr<torch::nn::Module> module;
  // Loss of the model on rows [first, first + count) of step's global batch.
  std::function<at::Tensor(int64_t step, int64_t first, int64_t count)> loss;
  std::function<void()> shard;  // empty: single-process reference
  std::function<void(int step)> before_step;  // sharded runs: called before each step's zero_grad
  std::shared_ptr<Communicator> comm;  // whose ranks share the batch; empty: the world
  int steps = 4;
  int64_t rows_per_rank = 2;
  double clip = 0;  // 0: no clipping
  bool optimizer_before_shard = false;
  bool sgd = false;  // plain SGD (lr kParitySgdLr) instead of AdamW
  double lr_scale = 1;  // for the test that the bounds catch a small error
  int micro_batches = 1;  // gradient accumulation: backward per slice, one step
  bool sync_every_micro_batch = true;  // false: set_requires_gradient_sync(false) but for the last
  // The arithmetic of the loss (see above): chain depth, and the longest sum given the rows of
  // the global batch.
  int chain_depth = 1;
  std::function<int64_t(int64_t global_rows)> longest_sum = [](int64_t rows) { return rows; };
};

// R_t: the largest |m_hat| / sqrt(v_hat) of Adam at step t (from 1), by Cauchy-Schwarz over the
// moments' bias-corrected weights w (first) and w2 (second): sqrt(sum w^2 / w2).
inline double adam_ratio_bound(int t, double beta1 = 0.9, double beta2 = 0.999) {
  double sum = 0;
  for (int s = 1; s <= t; ++s) {
    const double w = (1 - beta1) * std::pow(beta1, t - s) / (1 - std::pow(beta1, t));
    const double w2 = (1 - beta2) * std::pow(beta2, t - s) / (1 - std::pow(beta2, t));
    sum += w * w / w2;
  }
  return std::sqrt(sum);
}

inline double largest_gradient(torch::nn::Module& module) {
  double largest = 0;
  for (const auto& p : module.parameters())
    if (p.grad().defined()) largest = std::max(largest, p.grad().abs().max().item<double>());
  return largest;
}

// Runs a setup one step at a time, so that other work (another root's step) can run between.
class Trainer {
 public:
  explicit Trainer(TrainSetup setup) : s_(std::move(setup)), sharded_(static_cast<bool>(s_.shard)) {
    const double lr = (s_.sgd ? kParitySgdLr : kParityAdamLr) * s_.lr_scale;
    auto make_optimizer = [&]() -> std::unique_ptr<torch::optim::Optimizer> {
      if (s_.sgd) return std::make_unique<torch::optim::SGD>(s_.module->parameters(), torch::optim::SGDOptions(lr));
      return std::make_unique<torch::optim::AdamW>(
          s_.module->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0.1).eps(kParityAdamEps));
    };
    if (s_.optimizer_before_shard) optimizer_ = make_optimizer();
    if (sharded_) s_.shard();
    if (!optimizer_) optimizer_ = make_optimizer();
    lr_ = lr;
    eps_ = Rounding{s_.chain_depth, s_.longest_sum(s_.rows_per_rank * comm().world_size())}.eps();
  }
  Communicator& comm() const { return s_.comm ? *s_.comm : *world(); }

  // One optimizer step; `between` runs after the (last micro-batch's) loss, before its backward.
  void step(const std::function<void()>& between = {}) {
    const int step = step_++;
    if (sharded_ && s_.before_step) s_.before_step(step);
    optimizer_->zero_grad();
    const int64_t rows = sharded_ ? s_.rows_per_rank : s_.rows_per_rank * comm().world_size();
    const int64_t first = sharded_ ? comm().rank() * s_.rows_per_rank : 0;
    const int64_t slice = rows / s_.micro_batches;
    at::Tensor loss = torch::zeros({}, on_device());
    for (int m = 0; m < s_.micro_batches; ++m) {
      if (sharded_ && !s_.sync_every_micro_batch) set_requires_gradient_sync(*s_.module, m == s_.micro_batches - 1);
      at::Tensor part = s_.loss(step, first + m * slice, slice) / s_.micro_batches;
      if (between && m == s_.micro_batches - 1) between();
      part.backward();
      loss += part.detach();
    }
    if (s_.clip > 0) {
      if (sharded_) {
        // grad_norm leaves the gradients as they are: the clip then takes the same norm.
        const double unclipped = grad_norm(*s_.module).item<double>();
        result_.grad_norms.push_back(clip_grad_norm_(*s_.module, s_.clip).item<double>());
        EXPECT_EQ(unclipped, result_.grad_norms.back()) << "step " << step;
      } else {
        result_.grad_norms.push_back(torch::nn::utils::clip_grad_norm_(s_.module->parameters(), s_.clip));
      }
    }
    if (!sharded_) {
      const double step_eps = (step + 1) * eps_;
      result_.bounds.relative.push_back(step_eps);
      const double delta = step_eps * largest_gradient(*s_.module) * (s_.clip > 0 ? 2 : 1);
      largest_delta_ = std::max(largest_delta_, delta);
      result_.bounds.parameters += s_.sgd ? lr_ * delta
                                          : lr_ * (1 + adam_ratio_bound(step + 1)) * largest_delta_ / kParityAdamEps;
    }
    optimizer_->step();
    at::Tensor global = loss.detach().clone();
    if (sharded_) comm().all_reduce(global, ReduceOp::Avg);
    result_.losses.push_back(global.item<double>());
  }

  // Collective when sharded: the losses so far and the full parameters now.
  TrainResult result() {
    TrainResult r = result_;
    for (const auto& item : s_.module->named_parameters())
      if (!item.value().grad().defined()) r.params_without_grad.push_back(item.key());
    r.params = full_values(*s_.module, sharded_);
    return r;
  }
  // The full parameters and buffers of `module`, gathered when sharded (collective then).
  static std::vector<std::pair<std::string, at::Tensor>> full_values(torch::nn::Module& module, bool sharded) {
    if (sharded) return full_state_dict(module);
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value().detach().clone());
    for (const auto& item : module.named_buffers()) out.emplace_back(item.key(), item.value().detach().clone());
    return out;
  }

 private:
  TrainSetup s_;
  bool sharded_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  double lr_ = 0, eps_ = 0, largest_delta_ = 0;
  int step_ = 0;
  TrainResult result_;
};

inline TrainResult train(const TrainSetup& s) {
  Trainer trainer(s);
  for (int step = 0; step < s.steps; ++step) trainer.step();
  return trainer.result();
}

constexpr int64_t kLlamaSeq = 16;

inline TrainSetup llama_setup(TestLlama llama, std::function<void(TestLlama&)> shard = {}) {
  TrainSetup s;
  s.module = llama.ptr();
  s.loss = [llama](int64_t, int64_t first, int64_t count) mutable {
    const int64_t seq = kLlamaSeq;
    // The same batch every step, so the loss must fall steadily.
    auto tokens = token_rows(llama->config.vocab, 99, 0, first, count, seq).to(device());
    auto logits = fsdp::forward(llama, tokens.narrow(1, 0, seq));
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, llama->config.vocab}).to(torch::kFloat),
        tokens.narrow(1, 1, seq).reshape({-1}));
  };
  if (shard) s.shard = [llama, shard]() mutable { shard(llama); };
  // Per block: norm, q/k/v, scores, softmax, weighted values, output projection, norm,
  // gate/up, down (9 sums); around them embedding, final norm, head, loss; twice for backward.
  const auto& c = llama->config;
  s.chain_depth = 2 * (9 * static_cast<int>(c.n_layers) + 4);
  s.longest_sum = [c](int64_t rows) { return std::max({rows * kLlamaSeq, c.dim, c.ffn, c.vocab}); };
  return s;
}

inline TestLlama seeded_llama(TestLlamaConfig c, uint64_t seed = 5) {
  c.seed = seed;
  return TestLlama(c, TestPlacement{device()});
}

// A schedule (fsdp/plan/cost_model.h) on a TestLlama, as a front end applies the planner's: group
// 0 the root, group i + 1 block i. The model recomputes the blocks the schedule marks.
inline void recompute_as_scheduled(TestLlama& m, const plan::Schedule& schedule) {
  ASSERT_EQ(schedule.recompute.size(), m->blocks.size() + 1);
  ASSERT_FALSE(schedule.recompute[0]) << "the root is not recomputed";
  m->config.recompute_blocks = false;
  m->config.recomputed_blocks.clear();
  for (size_t i = 1; i < schedule.recompute.size(); ++i)
    if (schedule.recompute[i]) m->config.recomputed_blocks.push_back(static_cast<int64_t>(i - 1));
}

// On a sharded model that has run a step: all of the schedule.
inline void apply_schedule(TestLlama& m, const plan::Schedule& schedule) {
  recompute_as_scheduled(m, schedule);
  set_schedule(*m, schedule);
}

// Shards each block with the schedule's reshard choice, then the root, and sets the rest.
inline void shard_with_schedule(TestLlama& m, const plan::Schedule& schedule) {
  recompute_as_scheduled(m, schedule);
  for (size_t i = 0; i < m->blocks.size(); ++i) {
    ShardOptions options;
    options.reshard_after_forward = schedule.reshard_after_forward.at(i + 1);
    fully_shard(m->blocks[i], options);
  }
  fully_shard(m);
  set_runtime_choices(*m, schedule);
}

// One forward and backward of `m` on random tokens [2, 9]: the float32 cross-entropy of
// predicting the last 8 from the first 8 (the logits through fsdp::forward, not the fused loss).
inline void next_token_backward(TestLlama& m) {
  const int64_t vocab = m->config.vocab;
  auto tokens = torch::randint(0, vocab, {2, 9}, on_device(torch::kLong));
  torch::nn::functional::cross_entropy(fsdp::forward(m, tokens.narrow(1, 0, 8)).reshape({-1, vocab}).to(torch::kFloat),
                                       tokens.narrow(1, 1, 8).reshape({-1}))
      .backward();
}

inline void shard_blocks_and_root(TestLlama& m, const ShardOptions& o = {}) {
  for (auto& b : m->blocks) fully_shard(b, o);
  fully_shard(m, o);
}

// Compares a sharded run with its single-process reference within the reference's bounds.
// Returns what lies outside them (empty: the same run).
inline std::vector<std::string> run_differences(const TrainResult& got, const TrainResult& want) {
  std::vector<std::string> out;
  auto outside = [&](const std::string& what, double a, double b, double bound) {
    char line[256];
    std::snprintf(line, sizeof(line), "%s: %.9g vs %.9g, difference %.3g over the bound %.3g",
                  what.c_str(), a, b, std::abs(a - b), bound);
    if (std::getenv("FSDP_TEST_SHOW_DIFF")) std::printf("%s\n", line);
    if (!(std::abs(a - b) <= bound)) out.push_back(line);
  };
  if (got.losses.size() != want.losses.size() || got.params.size() != want.params.size() ||
      got.grad_norms.size() != want.grad_norms.size())
    return {"the runs differ in steps, parameters or clipping"};
  for (size_t i = 0; i < want.losses.size(); ++i)
    outside("loss of step " + std::to_string(i), got.losses[i], want.losses[i],
            want.bounds.relative[i] * std::abs(want.losses[i]));
  for (size_t i = 0; i < want.grad_norms.size(); ++i)
    outside("gradient norm of step " + std::to_string(i), got.grad_norms[i], want.grad_norms[i],
            want.bounds.relative[i] * want.grad_norms[i]);
  for (size_t i = 0; i < want.params.size(); ++i) {
    const auto& [name, value] = want.params[i];
    if (got.params[i].first != name || !got.params[i].second.sizes().equals(value.sizes())) {
      out.push_back("parameter " + got.params[i].first + " is not " + name + " of the same shape");
      continue;
    }
    const auto diff = (got.params[i].second - value).abs();
    const int64_t at = diff.flatten().argmax().item<int64_t>();
    outside(name + "[" + std::to_string(at) + "]", got.params[i].second.flatten()[at].item<double>(),
            value.flatten()[at].item<double>(), want.bounds.parameters);
  }
  if (got.params_without_grad != want.params_without_grad)
    out.push_back("the parameters without a gradient differ");
  return out;
}

inline void expect_same_run(const TrainResult& got, const TrainResult& want) {
  EXPECT_THAT(run_differences(got, want), ::testing::IsEmpty());
}

inline void expect_identical_run(const TrainResult& a, const TrainResult& b) {
  EXPECT_EQ(a.losses, b.losses);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(torch::equal(a.params[i].second, b.params[i].second)) << a.params[i].first;
}

}  // namespace fsdp::testing
