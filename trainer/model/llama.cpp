#include "model/llama.h"

#include <ATen/ops/rms_norm.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/embedding.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "fsdp/recompute.h"
#include "fsdp/fully_shard.h"
#include "model/linear_cross_entropy.h"

namespace fsdp::model {

bool LlamaConfig::recomputes(int64_t block) const {
  return recompute_blocks ||
         std::find(recomputed_blocks.begin(), recomputed_blocks.end(), block) != recomputed_blocks.end();
}

torch::Tensor LlamaConfig::rope_frequencies() const {
  const int64_t half = head_dim() / 2;
  auto frequencies = torch::pow(rope_theta, -torch::arange(0, half, torch::kDouble) / half);
  const auto& s = rope_scaling;
  if (s.factor <= 0) return frequencies;
  const double original = static_cast<double>(s.original_max_seq);
  const auto wavelength = 2 * M_PI / frequencies;
  // 0 where the wavelength is longer than original / low_freq_factor (scaled by 1 / factor), 1 where
  // it is shorter than original / high_freq_factor (kept), linear in original / wavelength between.
  const auto kept = ((original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1);
  return frequencies * (kept + (1 - kept) / s.factor);
}

int64_t LlamaConfig::block_parameter_count() const {
  const int64_t kv = n_kv_heads * head_dim();
  return 2 * dim + dim * dim * 2 + 2 * dim * kv + 3 * dim * ffn;
}

int64_t LlamaConfig::parameter_count() const {
  return vocab * dim * (tie_embeddings ? 1 : 2) + n_layers * block_parameter_count() + dim;
}

double LlamaConfig::flops_per_token(int64_t seq) const {
  // 6 FLOPs per token (forward + backward) for each weight of a matrix product: the blocks'
  // projections and the head, counted once whether or not it is tied (the embedding's lookup is a
  // gather, no FLOPs; nor are the norms). Plus causal attention's scores and values (QK^T and AV:
  // 2 * 2 * seq * dim per layer forward, halved for causality, times 3 for forward + backward).
  const int64_t block_matmul_weights = block_parameter_count() - 2 * dim;  // less its two norms' weights
  return 6.0 * (n_layers * block_matmul_weights + vocab * dim) + 6.0 * n_layers * seq * dim;
}

torch::Tensor Placement::parameter(at::IntArrayRef shape) const {
  const auto options = torch::TensorOptions().device(device);
  return deferred ? fsdp::deferred_parameter(shape, options) : torch::zeros(shape, options);
}

ProjectionImpl::ProjectionImpl(int64_t in, int64_t out, const Placement& where, Float8Recipe float8,
                               bool float8_all_gather)
    : float8_(float8) {
  weight = register_parameter("weight", where.parameter({out, in}));
  if (float8 == Float8Recipe::Tensorwise && float8_all_gather) enable_float8_all_gather(weight);
}

torch::Tensor ProjectionImpl::forward(const torch::Tensor& x) {
  return float8_ == Float8Recipe::Off ? torch::nn::functional::linear(x, weight) : float8_linear(x, weight, float8_);
}

EmbeddingImpl::EmbeddingImpl(int64_t vocab, int64_t dim, const Placement& where) {
  weight = register_parameter("weight", where.parameter({vocab, dim}));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& tokens) { return torch::embedding(weight, tokens); }

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, const Placement& where) : eps_(eps) {
  weight = register_parameter("weight", where.parameter({dim}));
}

// ATen's rms_norm: one fused kernel each way on CUDA; float32 arithmetic whatever the dtype.
torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) { return at::rms_norm(x, {weight.size(0)}, weight, eps_); }

namespace {

// A parameter's own seed: the model's seed and the parameter's name.
uint64_t seed_of(uint64_t model_seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull ^ model_seed;  // FNV-1a over the name
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

}  // namespace

AttentionImpl::AttentionImpl(const LlamaConfig& c, const Placement& where)
    : n_heads_(c.n_heads), n_kv_heads_(c.n_kv_heads), head_dim_(c.head_dim()), kernel_(c.attention) {
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0)
    throw std::invalid_argument("LlamaConfig: dim must divide into heads, heads into kv heads");
  wqkv = register_module(
      "wqkv", Projection(c.dim, (c.n_heads + 2 * c.n_kv_heads) * head_dim_, where, c.float8, c.float8_all_gather));
  wo = register_module("wo", Projection(c.n_heads * head_dim_, c.dim, where, c.float8, c.float8_all_gather));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  const int64_t b = x.size(0), t = x.size(1), heads = n_heads_ + 2 * n_kv_heads_;
  const auto qkv = rope_qkv(wqkv(x), cos, sin, heads, n_heads_ + n_kv_heads_);
  // Views [b, heads, t, d] of the rotated projection; their gradients meet again in one cat.
  const auto parts = qkv.view({b, t, heads, head_dim_}).split_with_sizes({n_heads_, n_kv_heads_, n_kv_heads_}, 2);
  const auto y =
      causal_attention(parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2), kernel_);
  return wo(y.transpose(1, 2).reshape({b, t, n_heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const LlamaConfig& c, const Placement& where) {
  w_gate_up = register_module("w_gate_up", Projection(c.dim, 2 * c.ffn, where, c.float8, c.float8_all_gather));
  w_down = register_module("w_down", Projection(c.ffn, c.dim, where, c.float8, c.float8_all_gather));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return w_down(swiglu(w_gate_up(x)));
}

BlockImpl::BlockImpl(const LlamaConfig& c, const Placement& where) {
  attn_norm = register_module("attn_norm", RMSNorm(c.dim, c.norm_eps, where));
  attn = register_module("attn", Attention(c, where));
  mlp_norm = register_module("mlp_norm", RMSNorm(c.dim, c.norm_eps, where));
  mlp = register_module("mlp", Mlp(c, where));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                 const torch::Tensor& sin) {
  auto h = x + fsdp::forward(attn, fsdp::forward(attn_norm, x), cos, sin);
  return h + fsdp::forward(mlp, fsdp::forward(mlp_norm, h));
}

LlamaImpl::LlamaImpl(const LlamaConfig& c, const Placement& where) : config(c) {
  tok_emb = register_module("tok_emb", Embedding(c.vocab, c.dim, where));
  auto block_list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layers; ++i) {
    blocks.push_back(Block(c, where));
    block_list->push_back(blocks.back());
  }
  norm = register_module("norm", RMSNorm(c.dim, c.norm_eps, where));
  if (!c.tie_embeddings) head = register_module("head", Projection(c.dim, c.vocab, where));
  auto angles = torch::outer(torch::arange(0, c.max_seq, torch::kDouble), c.rope_frequencies());
  rope_cos = register_buffer("rope_cos", angles.cos().to(where.device, torch::kFloat));
  rope_sin = register_buffer("rope_sin", angles.sin().to(where.device, torch::kFloat));
  if (!where.deferred) reset_parameters();
}

void LlamaImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const double out_std = 0.02 / std::sqrt(2.0 * config.n_layers);
  for (auto& item : named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    auto& p = item.value();
    const bool is_output_projection =
        name.find("wo.") != std::string::npos || name.find("w_down.") != std::string::npos;
    if (name.find("norm") != std::string::npos)
      p.fill_(1.0);
    else
      fsdp::init_normal_(p, seed_of(config.seed, name), is_output_projection ? out_std : 0.02);
  }
}

torch::Tensor LlamaImpl::final_hidden(const torch::Tensor& tokens) {
  const int64_t t = tokens.size(1);
  if (t > config.max_seq)
    throw std::invalid_argument("sequence length " + std::to_string(t) + " exceeds max_seq " +
                                std::to_string(config.max_seq));
  auto cos = rope_cos.narrow(0, 0, t), sin = rope_sin.narrow(0, 0, t);
  auto h = tok_emb(tokens);
  for (size_t i = 0; i < blocks.size(); ++i)
    h = config.recomputes(static_cast<int64_t>(i)) ? fsdp::recompute(blocks[i], h, cos, sin)
                                                    : fsdp::forward(blocks[i], h, cos, sin);
  return norm(h);
}

const torch::Tensor& LlamaImpl::output_weight() const { return head ? head->weight : tok_emb->weight; }

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens) {
  return torch::nn::functional::linear(final_hidden(tokens), output_weight());
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens, const torch::Tensor& targets) {
  const auto h = final_hidden(tokens);
  return linear_cross_entropy(h.reshape({-1, h.size(-1)}), output_weight(), targets.reshape({-1}));
}

}  // namespace fsdp::model
