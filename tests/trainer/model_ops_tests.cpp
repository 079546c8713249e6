// The Llama's fused operations against plain ATen formulas, on CPU (the GPU suite compares the
// CUDA kernels with the same references: tests/lib/gpu_tests.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "model/fused_ops.h"
#include "model/hf_llama.h"
#include "model/linear_cross_entropy.h"
#include "model/llama.h"

namespace {

using namespace fsdp::model;

// logits then cross_entropy, as a model without the fused loss computes them (float32 or wider).
torch::Tensor unfused_loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets) {
  const auto logits = torch::mm(hidden, weight.t());
  return torch::nn::functional::cross_entropy(logits.to(c10::promoteTypes(logits.scalar_type(), torch::kFloat)),
                                              targets);
}

// In float64 the chunked loss and its gradients are the unfused ones up to summation order
// (relative 1e-12 covers sums of a few hundred terms at 2^-53 each); chunks of 1, 3 and all rows.
TEST(LinearCrossEntropy, LossAndGradientsMatchLogitsThenCrossEntropyForAnyChunking) {
  torch::manual_seed(0);
  const int64_t rows = 10, dim = 6, vocab = 17;
  auto hidden = torch::randn({rows, dim}, torch::kDouble).requires_grad_();
  auto weight = torch::randn({vocab, dim}, torch::kDouble).requires_grad_();
  auto targets = torch::randint(0, vocab, {rows}, torch::kLong);
  auto expected = unfused_loss(hidden, weight, targets);
  auto expected_grads = torch::autograd::grad({expected * 3.0}, {hidden, weight});
  for (int64_t chunk_rows : {1, 3, 100}) {
    auto loss = linear_cross_entropy(hidden, weight, targets, chunk_rows * vocab * 4);
    EXPECT_EQ(loss.scalar_type(), torch::kDouble);
    auto grads = torch::autograd::grad({loss * 3.0}, {hidden, weight});  // the upstream gradient scales
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-12 * expected.item<double>()) << chunk_rows;
    EXPECT_TRUE(torch::allclose(grads[0], expected_grads[0], 1e-12, 1e-12)) << chunk_rows;
    EXPECT_TRUE(torch::allclose(grads[1], expected_grads[1], 1e-12, 1e-12)) << chunk_rows;
  }
}

TEST(LinearCrossEntropy, WithoutGradModeOnlyTheLossAndBadShapesAreNamed) {
  auto hidden = torch::randn({4, 3}), weight = torch::randn({5, 3});
  auto targets = torch::tensor({0, 4, 2, 1}, torch::kLong);
  torch::NoGradGuard no_grad;
  // float32: the loss of 4 rows agrees to a few ulps of float32.
  EXPECT_NEAR(linear_cross_entropy(hidden, weight, targets).item<double>(),
              unfused_loss(hidden, weight, targets).item<double>(), 1e-5);
  EXPECT_THROW(linear_cross_entropy(hidden, weight.t(), targets), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy(hidden, weight, targets.to(torch::kInt)), std::invalid_argument);
}

// The rotation of pairs (i, i + d/2) by angle p * f_i: at position 0 nothing moves, pair norms
// are kept, v heads are copied, and rotating by minus the angle undoes it.
TEST(FusedOps, RopeRotatesQAndKPairsAndCopiesV) {
  torch::manual_seed(1);
  const int64_t b = 2, t = 5, heads = 4, rotated = 3, d = 6;
  auto qkv = torch::randn({b, t, heads * d}, torch::kDouble);
  auto angles = torch::outer(torch::arange(t, torch::kDouble), torch::tensor({1.0, 0.3, 0.01}, torch::kDouble));
  auto cos = angles.cos().to(torch::kFloat), sin = angles.sin().to(torch::kFloat);
  auto out = rope_qkv(qkv, cos, sin, heads, rotated);
  auto x = qkv.view({b, t, heads, d}), y = out.view({b, t, heads, d});
  EXPECT_TRUE(torch::equal(y.select(1, 0), x.select(1, 0)));  // cos 1, sin 0: exact in float64
  EXPECT_TRUE(torch::equal(y.narrow(2, rotated, heads - rotated), x.narrow(2, rotated, heads - rotated)));
  auto pair_norms = [&](const torch::Tensor& v) {
    return v.narrow(-1, 0, d / 2).pow(2) + v.narrow(-1, d / 2, d / 2).pow(2);
  };
  EXPECT_TRUE(torch::allclose(pair_norms(y), pair_norms(x), 1e-6, 1e-6));  // cos^2 + sin^2 of float32 angles
  // Element (position 2, head 1, i = 1): x1 cos - x2 sin with angle 2 * 0.3.
  const double a = 0.6f, x1 = x[1][2][1][1].item<double>(), x2 = x[1][2][1][4].item<double>();
  EXPECT_NEAR(y[1][2][1][1].item<double>(), x1 * std::cos(a) - x2 * std::sin(a), 1e-6);
  EXPECT_NEAR(y[1][2][1][4].item<double>(), x2 * std::cos(a) + x1 * std::sin(a), 1e-6);
  EXPECT_TRUE(torch::allclose(rope_qkv(out, cos, -sin, heads, rotated), qkv, 1e-6, 1e-6));
  EXPECT_THROW(rope_qkv(qkv, cos.narrow(0, 0, 4), sin.narrow(0, 0, 4), heads, rotated), std::invalid_argument);
}

TEST(FusedOps, SwigluIsSiluOfGateTimesUp) {
  auto gate_up = torch::randn({3, 2, 8}, torch::kDouble);
  auto expected = torch::silu(gate_up.narrow(-1, 0, 4)) * gate_up.narrow(-1, 4, 4);
  EXPECT_TRUE(torch::allclose(swiglu(gate_up), expected, 1e-12, 1e-12));  // float64 throughout
  EXPECT_THROW(swiglu(torch::randn({3, 5})), std::invalid_argument);
}

// Attention written out: softmax(q k^T / sqrt(d)) v over the keys `allowed` lets each query see,
// each k/v head serving heads / kv_heads q heads.
torch::Tensor written_out_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& allowed) {
  const int64_t group = q.size(1) / k.size(1);
  const auto scores = torch::matmul(q, k.repeat_interleave(group, 1).transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  return torch::matmul(scores.masked_fill(allowed.logical_not(), -INFINITY).softmax(-1), v.repeat_interleave(group, 1));
}

// Causal attention with grouped k/v heads: on CPU every kernel choice takes ATen's path; float64
// agrees to summation order (1e-12).
TEST(FusedOps, CausalAttentionIsMaskedSoftmaxAttentionForEveryKernelChoice) {
  torch::manual_seed(2);
  const int64_t b = 2, heads = 4, kv_heads = 2, t = 5, d = 8;
  auto q = torch::randn({b, heads, t, d}, torch::kDouble);
  auto k = torch::randn({b, kv_heads, t, d}, torch::kDouble), v = torch::randn({b, kv_heads, t, d}, torch::kDouble);
  const auto expected = written_out_attention(q, k, v, torch::ones({t, t}, torch::kBool).tril());
  for (const char* name : {"aten", "flash"})
    EXPECT_TRUE(torch::allclose(causal_attention(q, k, v, attention_kernel_named(name)), expected, 1e-12, 1e-12))
        << name;
  EXPECT_THROW(attention_kernel_named("auto"), std::invalid_argument);
}

// Documents end with (and include) an end id or their row's end: their offsets in the flattened
// tokens, and as a mask each position sees the earlier positions of its own.
TEST(BlockCausal, DocumentsEndWithAnEndIdOrTheirRow) {
  const auto tokens = torch::tensor({5, 9, 3, 4, 8, 7, 2, 9, 9}, torch::kLong).view({3, 3});
  const auto offsets = document_offsets(tokens, {9, 8});
  EXPECT_TRUE(torch::equal(offsets, torch::tensor({0, 2, 3, 5, 6, 8, 9}, torch::kInt)));
  const auto expected = torch::tensor({1, 0, 0,  1, 1, 0,  0, 0, 1,    // 5 9 | 3
                                       1, 0, 0,  1, 1, 0,  0, 0, 1,    // 4 8 | 7
                                       1, 0, 0,  1, 1, 0,  0, 0, 1},   // 2 9 | 9
                                      torch::kBool)
                            .view({3, 1, 3, 3});
  EXPECT_TRUE(torch::equal(block_causal_mask(offsets, 3, 3), expected));
  EXPECT_TRUE(torch::equal(document_offsets(tokens, {}), torch::tensor({0, 3, 6, 9}, torch::kInt)));
}

// With documents, the attention of each query is the softmax over the earlier keys of its own
// document (grouped k/v heads expanded to q's), as written out in float64.
TEST(FusedOps, DocumentAttentionIsSoftmaxOverTheKeysOfTheQuerysDocument) {
  torch::manual_seed(4);
  const int64_t b = 2, heads = 4, kv_heads = 2, t = 6, d = 8;
  auto q = torch::randn({b, heads, t, d}, torch::kDouble);
  auto k = torch::randn({b, kv_heads, t, d}, torch::kDouble), v = torch::randn({b, kv_heads, t, d}, torch::kDouble);
  const auto offsets = torch::tensor({0, 2, 5, 6, 9, 12}, torch::kInt);  // row 0: 2, 3 and 1 tokens; row 1: 3 and 3
  const auto expected = written_out_attention(q, k, v, block_causal_mask(offsets, b, t));
  EXPECT_TRUE(torch::allclose(causal_attention(q, k, v, AttentionKernel::Aten, offsets), expected, 1e-12, 1e-12));
}

// A packed sequence under block_causal gives each document the logits it has alone (RoPE's scores
// depend only on distances, so a document later in the sequence is computed as at its start): in
// float32 to rounding (1e-7 measured on logits of up to 0.56; 1e-5 allowed), where causal attention
// over the whole sequence moves the second document's by 0.27.
TEST(BlockCausal, EachPackedDocumentGetsTheLogitsItHasAlone) {
  LlamaConfig c;
  c.n_kv_heads = 2;
  c.block_causal = true;
  c.eos_token_ids = {0};
  Llama model(c);
  torch::NoGradGuard no_grad;
  const auto first = torch::tensor({17, 42, 99, 0}, torch::kLong), second = torch::tensor({63, 7, 120, 5, 31}, torch::kLong);
  const auto packed = model->forward(torch::cat({first, second}).unsqueeze(0))[0];
  const auto alone_first = model->forward(first.unsqueeze(0))[0], alone_second = model->forward(second.unsqueeze(0))[0];
  EXPECT_TRUE(torch::allclose(packed.narrow(0, 0, 4), alone_first, 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(packed.narrow(0, 4, 5), alone_second, 1e-5, 1e-5));
  model->config.block_causal = false;
  const auto causal = model->forward(torch::cat({first, second}).unsqueeze(0))[0];
  EXPECT_GT((causal.narrow(0, 4, 5) - alone_second).abs().max().item<double>(), 1e-2);
}

// Initialisation tells its progress parameter by parameter, ending at every byte of the parameters.
TEST(LlamaInit, ProgressCountsEveryParametersBytes) {
  Llama model(LlamaConfig{});
  int64_t total = 0;
  for (const auto& p : model->parameters()) total += static_cast<int64_t>(p.nbytes());
  std::vector<std::pair<int64_t, int64_t>> told;
  model->reset_parameters([&](int64_t done, int64_t of) { told.emplace_back(done, of); });
  ASSERT_EQ(told.size(), model->parameters().size());
  for (size_t i = 0; i < told.size(); ++i) {
    EXPECT_EQ(told[i].second, total);
    EXPECT_GT(told[i].first, i ? told[i - 1].first : 0);
  }
  EXPECT_EQ(told.back().first, total);
}

// The model's fused loss is its logits' cross-entropy, and so are the gradients of every
// parameter (float32: relative 1e-4 covers the different summation orders of two paths).
TEST(FusedOps, ModelLossEqualsCrossEntropyOfItsLogits) {
  LlamaConfig c;
  c.n_kv_heads = 2;  // grouped-query attention: q, k and v of different sizes in one projection
  for (bool tied : {false, true}) {
    c.tie_embeddings = tied;
    Llama model(c);
    auto tokens = torch::randint(0, c.vocab, {2, 9}, torch::kLong);
    auto inputs = tokens.narrow(1, 0, 8), targets = tokens.narrow(1, 1, 8);
    auto params = model->parameters();
    auto fused = model->forward(inputs, targets);
    auto fused_grads = torch::autograd::grad({fused}, params);
    auto plain = torch::nn::functional::cross_entropy(model->forward(inputs).reshape({-1, c.vocab}),
                                                      targets.reshape({-1}));
    auto plain_grads = torch::autograd::grad({plain}, params);
    EXPECT_NEAR(fused.item<double>(), plain.item<double>(), 1e-5 * plain.item<double>());
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_TRUE(torch::allclose(fused_grads[i], plain_grads[i], 1e-4, 1e-7)) << i << " tied " << tied;
  }
}

TEST(HfParts, FusedProjectionsAreTheHuggingFaceTensorsStackedByRows) {
  LlamaConfig c;
  c.dim = 64, c.n_heads = 4, c.n_kv_heads = 2, c.ffn = 176;  // head_dim 16: q 64 rows, k and v 32
  auto qkv = hf_parts("blocks.3.attn.wqkv.weight", c);
  ASSERT_EQ(qkv.size(), 3u);
  EXPECT_EQ(qkv[0].name, "model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(qkv[1].name, "model.layers.3.self_attn.k_proj.weight");
  EXPECT_EQ(qkv[2].name, "model.layers.3.self_attn.v_proj.weight");
  EXPECT_EQ(qkv[1].first_row, 64);
  EXPECT_EQ(qkv[2].first_row, 96);
  EXPECT_EQ(qkv[2].rows, 32);
  auto gate_up = hf_parts("blocks.0.mlp.w_gate_up.weight", c);
  ASSERT_EQ(gate_up.size(), 2u);
  EXPECT_EQ(gate_up[1].name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(gate_up[1].first_row, 176);
  auto head = hf_parts("head.weight", c);
  ASSERT_EQ(head.size(), 1u);
  EXPECT_EQ(head[0].name, "lm_head.weight");
  EXPECT_EQ(head[0].rows, 0);  // the whole parameter
  EXPECT_THROW(hf_parts("blocks.0.attn.wq.weight", c), std::invalid_argument);
}

// Llama-3.2-3B's config.json as published (the fields a LlamaConfig reads): the 3b preset is that model.
TEST(LlamaPresets, ThreeBIsLlama32ThreeBsConfig) {
  const std::string dir = ::testing::TempDir() + "llama-3.2-3b";
  ASSERT_EQ(system(("mkdir -p " + dir).c_str()), 0);
  std::ofstream(dir + "/config.json") << R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "attention_bias": false, "mlp_bias": false, "head_dim": 128, "hidden_size": 3072,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 24,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "vocab_size": 128256,
    "eos_token_id": [128001, 128008, 128009]})";
  const auto hf = read_hf_config(dir), preset = LlamaConfig::preset("3b");
  EXPECT_EQ(hf.vocab, preset.vocab);
  EXPECT_EQ(hf.dim, preset.dim);
  EXPECT_EQ(hf.n_layers, preset.n_layers);
  EXPECT_EQ(hf.n_heads, preset.n_heads);
  EXPECT_EQ(hf.n_kv_heads, preset.n_kv_heads);
  EXPECT_EQ(hf.ffn, preset.ffn);
  EXPECT_EQ(hf.max_seq, preset.max_seq);
  EXPECT_EQ(hf.tie_embeddings, preset.tie_embeddings);
  EXPECT_TRUE(torch::equal(hf.rope_frequencies(), preset.rope_frequencies()));
  EXPECT_EQ(hf.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_NEAR(preset.parameter_count() / 1e9, 3.21, 0.01);  // Llama-3.2-3B's 3.21 billion
}

// Model FLOPs count the weights of matrix products: a tied and an untied head cost the same, the
// embedding's lookup nothing. 3b: 28 blocks of 2 x 3072^2 + 2 x 3072 x 1024 + 3 x 3072 x 8192
// weights and a 128256 x 3072 head, plus 6 x 28 x seq x 3072 for attention.
TEST(LlamaPresets, FlopsPerTokenCountMatrixProductsOnce) {
  auto c = LlamaConfig::preset("3b");
  const double expected = 6.0 * (28 * (2.0 * 3072 * 3072 + 2.0 * 3072 * 1024 + 3.0 * 3072 * 8192) + 128256.0 * 3072) +
                          6.0 * 28 * 2048 * 3072;
  EXPECT_EQ(c.flops_per_token(2048), expected);
  c.tie_embeddings = false;
  EXPECT_EQ(c.flops_per_token(2048), expected);
}

// Llama 3's scaling keeps the short wavelengths, divides the long ones by the factor and blends
// between (frequencies fall monotonically either way).
TEST(LlamaPresets, Llama3RopeScalingKeepsHighFrequenciesAndDividesLowOnes) {
  auto c = LlamaConfig::preset("3b");
  const auto scaled = c.rope_frequencies();
  c.rope_scaling.factor = 0;
  const auto plain = c.rope_frequencies();
  const auto wavelength = 2 * M_PI / plain;
  const auto ratio = scaled / plain;
  const auto short_ones = wavelength < 8192 / 4.0, long_ones = wavelength > 8192 / 1.0;
  EXPECT_TRUE(short_ones.any().item<bool>() && long_ones.any().item<bool>());
  EXPECT_TRUE(torch::allclose(ratio.masked_select(short_ones), torch::ones({1}, torch::kDouble)));
  EXPECT_TRUE(torch::allclose(ratio.masked_select(long_ones), torch::full({1}, 1 / 32.0, torch::kDouble)));
  EXPECT_TRUE((scaled.slice(0, 1) < scaled.slice(0, 0, -1)).all().item<bool>());
}

}  // namespace
