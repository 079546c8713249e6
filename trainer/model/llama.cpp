#include "model/llama.h"

#include <ATen/ops/rms_norm.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/embedding.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "fsdp/recompute.h"
#include "fsdp/fully_shard.h"
#include "fsdp/tensor_parallel.h"
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

namespace {

// A [rows, columns] parameter: this rank's part of it where `split` splits it over the tp ranks.
torch::Tensor matrix(const Placement& where, int64_t rows, int64_t columns, const Split& split) {
  if (!where.mesh.tp || split.dim < 0) return where.parameter({rows, columns});
  TpPart part{where.mesh.tp, where.mesh.replica, split.dim, split.sections, {rows, columns}};
  torch::Tensor weight = where.parameter(part.part_shape());
  set_tp_part(weight, std::move(part));
  return weight;
}

}  // namespace

ProjectionImpl::ProjectionImpl(int64_t in, int64_t out, const Placement& where, const Split& split,
                               Float8Recipe float8, bool float8_all_gather)
    : float8_(float8) {
  weight = register_parameter("weight", matrix(where, out, in, split));
  if (float8 == Float8Recipe::Tensorwise && float8_all_gather) enable_float8_all_gather(weight);
}

torch::Tensor ProjectionImpl::forward(const torch::Tensor& x) {
  return float8_ == Float8Recipe::Off ? torch::nn::functional::linear(x, weight) : float8_linear(x, weight, float8_);
}

EmbeddingImpl::EmbeddingImpl(int64_t vocab, int64_t dim, const Placement& where) : split_(where.mesh.tp != nullptr) {
  weight = register_parameter("weight", matrix(where, vocab, dim, {0, {vocab}}));
  if (split_) first_id_ = where.mesh.tp->rank() * weight.size(0);
}

// Split by vocabulary: the rows of this rank's ids, zeros for the others' (the tp ranks' sum is
// the lookup).
torch::Tensor EmbeddingImpl::forward(const torch::Tensor& tokens) {
  if (!split_) return torch::embedding(weight, tokens);
  const auto mine = (tokens >= first_id_) & (tokens < first_id_ + weight.size(0));
  const auto rows = torch::embedding(weight, (tokens - first_id_) * mine);
  return rows * mine.unsqueeze(-1).to(rows.scalar_type());
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, const Placement& where) : eps_(eps), tp_(where.mesh.tp) {
  weight = register_parameter("weight", where.parameter({dim}));
}

// ATen's rms_norm: one fused kernel each way on CUDA; float32 arithmetic whatever the dtype.
torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return at::rms_norm(x, {weight.size(0)}, tp_ ? tp::copy_in(weight, *tp_) : weight, eps_);
}

namespace {

// A parameter's own seed: the model's seed and the parameter's name.
uint64_t seed_of(uint64_t model_seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull ^ model_seed;  // FNV-1a over the name
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

}  // namespace

AttentionImpl::AttentionImpl(const LlamaConfig& c, const Placement& where)
    : n_heads_(c.n_heads), n_kv_heads_(c.n_kv_heads), head_dim_(c.head_dim()), kernel_(c.attention), tp_(where.mesh.tp) {
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0)
    throw std::invalid_argument("LlamaConfig: dim must divide into heads, heads into kv heads");
  const int64_t q = c.n_heads * head_dim_, kv = c.n_kv_heads * head_dim_;
  wqkv = register_module("wqkv", Projection(c.dim, q + 2 * kv, where, Split{0, {q, kv, kv}}, c.float8, c.float8_all_gather));
  wo = register_module("wo", Projection(q, c.dim, where, Split{1, {q}}, c.float8, c.float8_all_gather));
  if (tp_) {  // this rank's heads (TpPart checked that they split)
    n_heads_ /= tp_->world_size();
    n_kv_heads_ /= tp_->world_size();
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& documents) {
  const int64_t t = cos.size(0), heads = n_heads_ + 2 * n_kv_heads_;
  const auto in = tp_ ? tp::gather_rows(x, *tp_) : x;
  const int64_t b = in.numel() / (t * in.size(-1));
  const auto qkv = rope_qkv(wqkv(in.view({b, t, in.size(-1)})), cos, sin, heads, n_heads_ + n_kv_heads_);
  // Views [b, heads, t, d] of the rotated projection; their gradients meet again in one cat.
  const auto parts = qkv.view({b, t, heads, head_dim_}).split_with_sizes({n_heads_, n_kv_heads_, n_kv_heads_}, 2);
  const auto y =
      causal_attention(parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2), kernel_, documents);
  const auto out = wo(y.transpose(1, 2).reshape({b, t, n_heads_ * head_dim_}));
  return tp_ ? tp::scatter_rows(out.view({b * t, out.size(-1)}), *tp_) : out;
}

MlpImpl::MlpImpl(const LlamaConfig& c, const Placement& where) : tp_(where.mesh.tp) {
  w_gate_up = register_module("w_gate_up",
                              Projection(c.dim, 2 * c.ffn, where, Split{0, {c.ffn, c.ffn}}, c.float8, c.float8_all_gather));
  w_down = register_module("w_down", Projection(c.ffn, c.dim, where, Split{1, {c.ffn}}, c.float8, c.float8_all_gather));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  if (!tp_) return w_down(swiglu(w_gate_up(x)));
  return tp::scatter_rows(w_down(swiglu(w_gate_up(tp::gather_rows(x, *tp_)))), *tp_);
}

BlockImpl::BlockImpl(const LlamaConfig& c, const Placement& where) {
  attn_norm = register_module("attn_norm", RMSNorm(c.dim, c.norm_eps, where));
  attn = register_module("attn", Attention(c, where));
  mlp_norm = register_module("mlp_norm", RMSNorm(c.dim, c.norm_eps, where));
  mlp = register_module("mlp", Mlp(c, where));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& documents) {
  auto h = x + fsdp::forward(attn, fsdp::forward(attn_norm, x), cos, sin, documents);
  return h + fsdp::forward(mlp, fsdp::forward(mlp_norm, h));
}

LlamaImpl::LlamaImpl(const LlamaConfig& c, const Placement& where) : config(c), tp_(where.mesh.tp) {
  tok_emb = register_module("tok_emb", Embedding(c.vocab, c.dim, where));
  auto block_list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layers; ++i) {
    blocks.push_back(Block(c, where));
    block_list->push_back(blocks.back());
  }
  norm = register_module("norm", RMSNorm(c.dim, c.norm_eps, where));
  if (!c.tie_embeddings) head = register_module("head", Projection(c.dim, c.vocab, where, Split{0, {c.vocab}}));
  auto angles = torch::outer(torch::arange(0, c.max_seq, torch::kDouble), c.rope_frequencies());
  rope_cos = register_buffer("rope_cos", angles.cos().to(where.device, torch::kFloat));
  rope_sin = register_buffer("rope_sin", angles.sin().to(where.device, torch::kFloat));
  if (!where.deferred) reset_parameters();
}

void LlamaImpl::reset_parameters(const ByteProgress& progress) {
  torch::NoGradGuard no_grad;
  const double out_std = 0.02 / std::sqrt(2.0 * config.n_layers);
  int64_t done = 0, total = 0;
  for (const auto& p : parameters()) total += static_cast<int64_t>(p.nbytes());
  for (auto& item : named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    auto& p = item.value();
    const bool is_output_projection =
        name.find("wo.") != std::string::npos || name.find("w_down.") != std::string::npos;
    if (name.find("norm") != std::string::npos)
      p.fill_(1.0);
    else
      fsdp::init_normal_(p, seed_of(config.seed, name), is_output_projection ? out_std : 0.02);
    done += static_cast<int64_t>(p.nbytes());
    if (progress) progress(done, total);
  }
}

torch::Tensor LlamaImpl::final_hidden(const torch::Tensor& tokens) {
  const int64_t t = tokens.size(1);
  if (t > config.max_seq)
    throw std::invalid_argument("sequence length " + std::to_string(t) + " exceeds max_seq " +
                                std::to_string(config.max_seq));
  auto cos = rope_cos.narrow(0, 0, t), sin = rope_sin.narrow(0, 0, t);
  const auto documents = config.block_causal ? document_offsets(tokens, config.eos_token_ids) : torch::Tensor();
  auto h = tok_emb(tokens);
  if (tp_) h = tp::scatter_rows(h.view({-1, h.size(-1)}), *tp_);  // this rank's tokens
  for (size_t i = 0; i < blocks.size(); ++i)
    h = config.recomputes(static_cast<int64_t>(i)) ? fsdp::recompute(blocks[i], h, cos, sin, documents)
                                                    : fsdp::forward(blocks[i], h, cos, sin, documents);
  return tp_ ? tp::gather_rows(norm(h), *tp_) : norm(h);
}

const torch::Tensor& LlamaImpl::output_weight() const { return head ? head->weight : tok_emb->weight; }

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens) {
  const auto logits = torch::nn::functional::linear(final_hidden(tokens), output_weight());
  if (!tp_) return logits;
  // [tp, tokens, vocab / tp] -> [tokens, vocab]: the parts are the vocabulary's ranges in rank order.
  auto parts = torch::empty({tp_->world_size(), logits.size(0), logits.size(1)}, logits.options());
  tp_->all_gather(parts, logits.detach().contiguous());
  return parts.permute({1, 0, 2}).reshape({tokens.size(0), tokens.size(1), -1});
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens, const torch::Tensor& targets) {
  const auto h = final_hidden(tokens);
  return linear_cross_entropy(h.reshape({-1, h.size(-1)}), output_weight(), targets.reshape({-1}), kLossChunkBytes,
                              tp_.get());
}

}  // namespace fsdp::model
