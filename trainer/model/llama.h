// A Llama-style decoder in torch::nn: RMSNorm (ATen's fused kernel), one QKV projection with
// rotary embeddings (fused_ops), causal attention through scaled_dot_product_attention, one
// gate/up projection with a fused SwiGLU, and an output projection fused with the loss
// (linear_cross_entropy). Its forward calls each block through fsdp::forward, so blocks can be
// sharded one by one.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "fsdp/mesh.h"
#include "fsdp/float8.h"
#include "fsdp/sharded_checkpoint.h"  // fsdp::ByteProgress
#include "model/fused_ops.h"

namespace fsdp::model {

struct LlamaConfig {
  int64_t vocab = 256;
  int64_t dim = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 4;
  int64_t ffn = 176;
  int64_t max_seq = 512;
  double rope_theta = 10000.0;
  // Llama 3's RoPE scaling (Hugging Face rope_type "llama3"): frequencies whose wavelength exceeds
  // original_max_seq / low_freq_factor are divided by factor, those below original_max_seq /
  // high_freq_factor kept, those between blended. factor 0: no scaling.
  struct RopeScaling {
    double factor = 0.0;
    double low_freq_factor = 1.0;
    double high_freq_factor = 4.0;
    int64_t original_max_seq = 8192;
  } rope_scaling;
  double norm_eps = 1e-5;
  bool tie_embeddings = false;  // output head uses the embedding matrix
  bool recompute_blocks = false;  // recompute each block's activations in backward
  std::vector<int64_t> recomputed_blocks;  // or only these blocks' (selective recomputation)
  AttentionKernel attention = AttentionKernel::Aten;  // which attention kernel (fused_ops.h)
  // Packed documents (torchtitan's "block_causal"): each position attends only to the earlier
  // positions of its own document, which ends with any of eos_token_ids (or its row). With RoPE the
  // scores depend only on distances, so a document anywhere in a row is computed as if alone.
  // false: causal over the whole sequence.
  bool block_causal = false;
  std::vector<int64_t> eos_token_ids;  // config.json's eos_token_id (an id, or a list of them)
  Float8Recipe float8 = Float8Recipe::Off;  // the blocks' projections in float8 (fsdp/float8.h), not the head
  bool float8_all_gather = false;  // tensorwise: their weights all-gathered in float8 (enable_float8_all_gather)
  uint64_t seed = 0;  // initial weights (reset_parameters)

  // The presets of model/presets.json: "tiny" (tests, CPU demo), "small" (a CPU-bound GPU size), "1b",
  // "3b" (Llama-3.2-3B's shapes), "8b". Throws naming the presets for another name.
  static LlamaConfig preset(const std::string& name);
  int64_t head_dim() const { return dim / n_heads; }
  // RoPE's angle per position of each pair of a head's dimensions, scaled: float64 [head_dim / 2].
  torch::Tensor rope_frequencies() const;
  bool recomputes(int64_t block) const;
  int64_t parameter_count() const;
  // One block's (a parameter group of its own when blocks are sharded one by one).
  int64_t block_parameter_count() const;
  // Forward+backward FLOPs per token (6 N plus attention), for MFU.
  double flops_per_token(int64_t seq) const;
};

// Where the parameters are made. Deferred: full-shaped placeholders without memory
// (fsdp::deferred_parameter) on `device`, to be sharded and then filled by reset_parameters()
// or by loaded weights; no process ever holds the whole model. With `mesh.tp` (tensor
// parallelism, fsdp/tensor_parallel.h) each layer's matrices are split over its ranks, and the
// model runs sequence-parallel: between the split layers each tp rank holds its rows of the tokens.
struct Placement {
  c10::Device device = c10::kCPU;
  bool deferred = false;
  Mesh mesh;  // make_mesh's; its tp null: no tensor parallelism
  torch::Tensor parameter(at::IntArrayRef shape) const;
};

// How a projection's weight [out, in] is split over the tp ranks (fsdp::TpPart): along `dim` (0:
// column-parallel, its output features; 1: row-parallel, its input features), in `sections`
// (a fused projection's stacked parts, each split alike); dim -1: not split.
struct Split {
  int64_t dim = -1;
  std::vector<int64_t> sections;
};

// torch::nn::Linear without bias (weight [out, in], the same parameter name; this rank's part of
// it where `split` splits it over the tp ranks), in float8 by `float8` unless Off (with
// float8_all_gather and tensorwise, its weight gathered in float8), and torch::nn::Embedding
// (split by vocabulary over the tp ranks: its forward gives this rank's partial sum), made on a
// Placement.
class ProjectionImpl : public torch::nn::Module {
 public:
  ProjectionImpl(int64_t in, int64_t out, const Placement& where, const Split& split = {},
                 Float8Recipe float8 = Float8Recipe::Off, bool float8_all_gather = false);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  Float8Recipe float8_;
};
TORCH_MODULE(Projection);

class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t vocab, int64_t dim, const Placement& where);
  torch::Tensor forward(const torch::Tensor& tokens);
  torch::Tensor weight;

 private:
  int64_t first_id_ = 0;  // of this rank's part of the vocabulary
  bool split_ = false;
};
TORCH_MODULE(Embedding);

// Under tensor parallelism its weight is the same on every tp rank and each rank normalises its
// own tokens: the weight's gradient is summed over the tp ranks (fsdp::tp::copy_in).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, const Placement& where);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
  std::shared_ptr<Communicator> tp_;
};
TORCH_MODULE(RMSNorm);

// x: [batch, seq, dim], or under tensor parallelism this rank's rows of the [batch * seq, dim]
// tokens (gathered in, the output scattered back as the tp ranks' sum); each tp rank computes its
// heads.
class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const LlamaConfig& c, const Placement& where);
  // documents: document_offsets' (fused_ops.h), or undefined for causal attention over the sequence.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& documents);
  Projection wqkv{nullptr};  // q, k and v stacked by rows (Hugging Face's q_proj, k_proj, v_proj)
  Projection wo{nullptr};

 private:
  int64_t n_heads_, n_kv_heads_, head_dim_;  // this rank's heads
  AttentionKernel kernel_;
  std::shared_ptr<Communicator> tp_;
};
TORCH_MODULE(Attention);

// Under tensor parallelism as attention: each tp rank computes its FFN columns.
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const LlamaConfig& c, const Placement& where);
  torch::Tensor forward(const torch::Tensor& x);
  Projection w_gate_up{nullptr};  // gate and up stacked by rows (gate_proj, up_proj)
  Projection w_down{nullptr};

 private:
  std::shared_ptr<Communicator> tp_;
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const LlamaConfig& c, const Placement& where);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& documents);
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

class LlamaImpl : public torch::nn::Module {
 public:
  // Initialised at once (reset_parameters), unless the placement defers the parameters.
  explicit LlamaImpl(const LlamaConfig& c, const Placement& where = {});
  // tokens: [batch, seq] int64 -> logits [batch, seq, vocab] (under tensor parallelism the tp
  // ranks' parts gathered, outside autograd: for evaluation)
  torch::Tensor forward(const torch::Tensor& tokens);
  // The mean cross-entropy of predicting targets [batch, seq] (int64, each below vocab), float32,
  // without materialising the logits (linear_cross_entropy; under tensor parallelism over the
  // vocabulary's parts, the same loss on every tp rank).
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& targets);
  // Initial weights from config.seed, sharded or not: near-normal with std 0.02 (fsdp::init_normal_,
  // one seed per parameter name), output projections scaled by 1/sqrt(2 * n_layers), norms at 1.
  // The same values on any number of ranks. `progress` is told this rank's bytes filled as each
  // parameter is.
  void reset_parameters(const ByteProgress& progress = {});

  LlamaConfig config;
  Embedding tok_emb{nullptr};
  std::vector<Block> blocks;
  RMSNorm norm{nullptr};
  Projection head{nullptr};  // null when tie_embeddings
  torch::Tensor rope_cos, rope_sin;  // [max_seq, head_dim / 2] buffers

 private:
  // After the last norm: [batch, seq, dim], or under tensor parallelism [batch * seq, dim] (every
  // token, gathered from the tp ranks).
  torch::Tensor final_hidden(const torch::Tensor& tokens);
  std::shared_ptr<Communicator> tp_;
  const torch::Tensor& output_weight() const;
};
TORCH_MODULE(Llama);

}  // namespace fsdp::model
