// The library's tests' own small Llama, written with libtorch and fsdp's public API alone (the
// library's tests do not link the trainer): an embedding, blocks of RMS norm, grouped-query
// causal attention (no rotary embedding: position comes from the causal mask alone) and a SwiGLU
// MLP, a final norm and a head. Its parameters have the trainer's Llama's names and shapes, so
// the tests' arithmetic on group sizes holds for both; the blocks can be recomputed
// (fsdp::recompute), their projections run in float8 (fsdp::float8_linear), and the whole model
// can be made deferred (fsdp::deferred_parameter) and filled after sharding.
#pragma once

#include <ATen/ops/rms_norm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"

namespace fsdp::testing {

struct TestLlamaConfig {
  int64_t vocab = 64, dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, ffn = 48, max_seq = 32;
  bool tie_embeddings = false;             // the head is the embedding matrix
  bool recompute_blocks = false;           // every block recomputed in backward
  std::vector<int64_t> recomputed_blocks;  // or only these
  Float8Recipe float8 = Float8Recipe::Off;  // the blocks' projections
  bool float8_all_gather = false;           // tensorwise: their weights gathered in float8
  uint64_t seed = 0;                        // initial weights (reset_parameters)

  int64_t head_dim() const { return dim / n_heads; }
  bool recomputes(int64_t block) const {
    return recompute_blocks ||
           std::find(recomputed_blocks.begin(), recomputed_blocks.end(), block) != recomputed_blocks.end();
  }
};

// Where parameters are made: full zeros on `device`, or deferred placeholders to be sharded and
// then filled by reset_parameters().
struct TestPlacement {
  c10::Device device = c10::kCPU;
  bool deferred = false;
  at::Tensor parameter(at::IntArrayRef shape) const {
    const auto options = at::TensorOptions().device(device);
    return deferred ? deferred_parameter(shape, options) : at::zeros(shape, options);
  }
};

// A module holding one parameter, `weight`.
class TestWeightImpl : public torch::nn::Module {
 public:
  TestWeightImpl(at::IntArrayRef shape, const TestPlacement& where) {
    weight = register_parameter("weight", where.parameter(shape));
  }
  at::Tensor weight;
};

// A linear layer without bias, in float8 where the config says so.
class TestProjectionImpl : public TestWeightImpl {
 public:
  TestProjectionImpl(int64_t in, int64_t out, const TestPlacement& where, const TestLlamaConfig& c)
      : TestWeightImpl({out, in}, where), float8_(c.float8) {
    if (c.float8 == Float8Recipe::Tensorwise && c.float8_all_gather) enable_float8_all_gather(weight);
  }
  at::Tensor forward(const at::Tensor& x) {
    return float8_ == Float8Recipe::Off ? at::linear(x, weight) : float8_linear(x, weight, float8_);
  }

 private:
  Float8Recipe float8_;
};
TORCH_MODULE(TestProjection);

class TestRmsNormImpl : public TestWeightImpl {
 public:
  TestRmsNormImpl(int64_t dim, const TestPlacement& where) : TestWeightImpl({dim}, where) {}
  at::Tensor forward(const at::Tensor& x) { return at::rms_norm(x, {weight.size(0)}, weight, 1e-5); }
};
TORCH_MODULE(TestRmsNorm);

class TestAttentionImpl : public torch::nn::Module {
 public:
  TestAttentionImpl(const TestLlamaConfig& c, const TestPlacement& where) : c_(c) {
    wqkv = register_module("wqkv", TestProjection(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim(), where, c));
    wo = register_module("wo", TestProjection(c.n_heads * c.head_dim(), c.dim, where, c));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), d = c_.head_dim(), per_kv = c_.n_heads / c_.n_kv_heads;
    const auto heads = wqkv(x).view({b, t, c_.n_heads + 2 * c_.n_kv_heads, d}).transpose(1, 2);
    const auto q = heads.narrow(1, 0, c_.n_heads);
    const auto k = heads.narrow(1, c_.n_heads, c_.n_kv_heads).repeat_interleave(per_kv, 1);
    const auto v = heads.narrow(1, c_.n_heads + c_.n_kv_heads, c_.n_kv_heads).repeat_interleave(per_kv, 1);
    const auto y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    return wo(y.transpose(1, 2).reshape({b, t, c_.n_heads * d}));
  }
  TestProjection wqkv{nullptr}, wo{nullptr};

 private:
  TestLlamaConfig c_;
};
TORCH_MODULE(TestAttention);

class TestMlpImpl : public torch::nn::Module {
 public:
  TestMlpImpl(const TestLlamaConfig& c, const TestPlacement& where) {
    w_gate_up = register_module("w_gate_up", TestProjection(c.dim, 2 * c.ffn, where, c));
    w_down = register_module("w_down", TestProjection(c.ffn, c.dim, where, c));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto gate_up = w_gate_up(x).chunk(2, -1);
    return w_down(at::silu(gate_up[0]) * gate_up[1]);
  }
  TestProjection w_gate_up{nullptr}, w_down{nullptr};
};
TORCH_MODULE(TestMlp);

class TestBlockImpl : public torch::nn::Module {
 public:
  TestBlockImpl(const TestLlamaConfig& c, const TestPlacement& where) {
    attn_norm = register_module("attn_norm", TestRmsNorm(c.dim, where));
    attn = register_module("attn", TestAttention(c, where));
    mlp_norm = register_module("mlp_norm", TestRmsNorm(c.dim, where));
    mlp = register_module("mlp", TestMlp(c, where));
  }
  // Through fsdp::forward, so that tests may shard the norms, attention or MLP on their own.
  at::Tensor forward(const at::Tensor& x) {
    const auto h = x + fsdp::forward(attn, fsdp::forward(attn_norm, x));
    return h + fsdp::forward(mlp, fsdp::forward(mlp_norm, h));
  }
  TestRmsNorm attn_norm{nullptr}, mlp_norm{nullptr};
  TestAttention attn{nullptr};
  TestMlp mlp{nullptr};
};
TORCH_MODULE(TestBlock);

class TestLlamaImpl : public torch::nn::Module {
 public:
  explicit TestLlamaImpl(const TestLlamaConfig& c, const TestPlacement& where = {}) : config(c) {
    tok_emb = register_module("tok_emb", std::make_shared<TestWeightImpl>(std::vector<int64_t>{c.vocab, c.dim}, where));
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_layers; ++i) {
      blocks.push_back(TestBlock(c, where));
      list->push_back(blocks.back());
    }
    norm = register_module("norm", TestRmsNorm(c.dim, where));
    if (!c.tie_embeddings) head = register_module("head", std::make_shared<TestWeightImpl>(std::vector<int64_t>{c.vocab, c.dim}, where));
    if (!where.deferred) reset_parameters();
  }

  // Norms 1; every other weight normal with std 0.02 (0.02 / sqrt(2 * layers) for the projections
  // back into the residual stream), each from its own seed (the model's and its name), so that a
  // sharded model fills the same values as a whole one (fsdp::init_normal_).
  void reset_parameters() {
    torch::NoGradGuard no_grad;
    const double residual_std = 0.02 / std::sqrt(2.0 * config.n_layers);
    for (auto& item : named_parameters()) {
      const std::string& name = item.key();
      if (name.find("norm") != std::string::npos) {
        item.value().fill_(1.0);
        continue;
      }
      const bool into_residual = name.find("wo.") != std::string::npos || name.find("w_down.") != std::string::npos;
      init_normal_(item.value(), config.seed * 1000003u + std::hash<std::string>{}(name),
                   into_residual ? residual_std : 0.02);
    }
  }

  // Logits [batch, seq, vocab].
  at::Tensor forward(const at::Tensor& tokens) {
    auto h = at::embedding(tok_emb->weight, tokens);
    for (size_t i = 0; i < blocks.size(); ++i)
      h = config.recomputes(static_cast<int64_t>(i)) ? fsdp::recompute(blocks[i], h) : fsdp::forward(blocks[i], h);
    return at::linear(norm(h), head ? head->weight : tok_emb->weight);
  }
  // The mean float32 cross-entropy of the logits against `targets`.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& targets) {
    const auto logits = forward(tokens);
    return at::cross_entropy_loss(logits.reshape({-1, config.vocab}).to(at::kFloat), targets.reshape({-1}));
  }

  TestLlamaConfig config;
  std::shared_ptr<TestWeightImpl> tok_emb, head;
  std::vector<TestBlock> blocks;
  TestRmsNorm norm{nullptr};
};
TORCH_MODULE(TestLlama);

// Learnable token rows: global row r of step s counts up (mod vocab) from a start drawn from
// (seed, step, r), so every rank computes the same global batch and takes its own rows of it.
// [count, seq + 1] int64 on the CPU: rows [first, first + count) of the step's batch.
inline at::Tensor token_rows(int64_t vocab, uint64_t seed, int64_t step, int64_t first, int64_t count, int64_t seq) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed * 7919u + static_cast<uint64_t>(step));
  const auto starts = at::randint(vocab, {first + count, 1}, generator, at::kLong).narrow(0, first, count);
  return (starts + at::arange(seq + 1, at::kLong)).remainder(vocab);
}

}  // namespace fsdp::testing
