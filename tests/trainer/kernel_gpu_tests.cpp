// The trainer's CUDA kernels against their ATen references, on one GPU (ctest trainer_gpu, where
// GPUs are): fused RoPE and SwiGLU, the fused AdamW step, the chunked output projection and loss,
// the attention kernel choice.
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "model/fused_ops.h"
#include "model/linear_cross_entropy.h"
#include "train/fused_adamw.h"

namespace fsdp {
namespace {

at::TensorOptions on_device(torch::Dtype dtype = torch::kFloat) { return at::TensorOptions().dtype(dtype).device(at::kCUDA); }

// The fused kernels against the ATen references (both float32 arithmetic, one rounding): float32
// agrees to a few ulps (the kernels contract multiply-adds into FMAs, expf differs by an ulp);
// 16-bit results may round to the neighbouring value, so they agree to one ulp of the dtype
// (bf16 2^-8, fp16 2^-11 relative). 3 x 7 rows, 5 heads of 10 or 16, 2 of them v.
double ulp_tolerance(torch::Dtype dtype) {
  return dtype == torch::kFloat ? 1e-5 : dtype == torch::kHalf ? 1.0 / 1024 : 1.0 / 128;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& expected, double rtol, const std::string& what) {
  const auto g = got.to(torch::kDouble), e = expected.to(torch::kDouble);
  const double worst = ((g - e).abs() - rtol * e.abs()).max().item<double>();
  // Plus an absolute 0.1 rtol: where q cos - k sin cancels, the FMA's one rounding less shows as
  // ~1e-7 absolute (inputs ~N(0, 1)), however small the result.
  EXPECT_LE(worst, 0.1 * rtol) << what << ": largest excess " << worst;
}

TEST(TrainerGpu, FusedRopeAndSwigluMatchTheirReferencesInValuesAndGradients) {
  ASSERT_TRUE(model::have_fused_kernels()) << "this GPU build was made without the fused kernels (no nvcc?)";
  const int64_t b = 3, t = 7, heads = 5, rotated = 3;
  // Odd sizes take the one-element kernels; head_dim 16 and ffn 64 the packed ones (16 bytes an access).
  for (auto [d, ffn] : {std::pair<int64_t, int64_t>{10, 37}, {16, 64}})
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    auto angles = torch::outer(torch::arange(t, on_device(torch::kDouble)),
                               torch::linspace(1, 0.01, d / 2, on_device(torch::kDouble)));
    auto cos = angles.cos().to(torch::kFloat), sin = angles.sin().to(torch::kFloat);
    const double rtol = ulp_tolerance(dtype);
    const std::string name = std::string(c10::toString(dtype)) + " head_dim " + std::to_string(d);
    auto qkv = torch::randn({b, t, heads * d}, on_device(dtype)).requires_grad_();
    auto grad = torch::randn({b, t, heads * d}, on_device(dtype));
    auto fused = model::rope_qkv(qkv, cos, sin, heads, rotated);
    auto fused_grad = torch::autograd::grad({fused}, {qkv}, {grad})[0];
    auto plain = model::reference::rope_qkv(qkv, cos, sin, heads, rotated);
    auto plain_grad = torch::autograd::grad({plain}, {qkv}, {grad})[0];
    expect_close(fused, plain, rtol, "rope " + name);
    expect_close(fused_grad, plain_grad, rtol, "rope gradient " + name);

    auto gate_up = torch::randn({b, t, 2 * ffn}, on_device(dtype)).requires_grad_();
    auto grad_out = torch::randn({b, t, ffn}, on_device(dtype));
    auto fused_mlp = model::swiglu(gate_up);
    auto fused_mlp_grad = torch::autograd::grad({fused_mlp}, {gate_up}, {grad_out})[0];
    auto plain_mlp = model::reference::swiglu(gate_up);
    auto plain_mlp_grad = torch::autograd::grad({plain_mlp}, {gate_up}, {grad_out})[0];
    expect_close(fused_mlp, plain_mlp, rtol, "swiglu " + name);
    // The reference's backward rounds silu(g) and its derivative to the dtype on the way (ATen's
    // silu and mul kernels): two more roundings, so two more ulps.
    expect_close(fused_mlp_grad, plain_mlp_grad, 3 * rtol, "swiglu gradient " + name);
  }
}

// FusedAdamW's own GPU kernel against ATen's fused AdamW (what it runs on CPUs), which divides
// the gradients by grad_scale as ours does by its divisor. The same float32 operations in the
// same order: within an ulp or two where the compilers contract a multiply-add differently.
// 40 tensors (two launches of at most 32), sizes with tails and several blocks' chunks, and one
// parameter and one gradient one element off alignment (the one-element path). Gradients in
// `grad_dtype`: float32, or bf16 as fsdp's keep_low_precision_grads leaves them, which ATen's
// kernel, the reference, takes cast to float32.
void expect_adamw_kernel_matches_atens(torch::Dtype grad_dtype) {
  torch::manual_seed(11);
  std::vector<int64_t> sizes = {1, 3, 4, 5, 4096 * 4 + 5, 70001};
  while (sizes.size() < 40) sizes.push_back(97 * static_cast<int64_t>(sizes.size()));
  std::vector<at::Tensor> ours, reference, grads;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    const bool unaligned = i == 4;
    auto storage = torch::randn({n + 1}, on_device(torch::kFloat));
    auto param = unaligned ? storage.narrow(0, 1, n) : storage.narrow(0, 0, n);
    ours.push_back(param.requires_grad_(false));
    reference.push_back(param.clone());
  }
  const auto options = torch::optim::AdamWOptions(3e-2).betas({0.9, 0.95}).weight_decay(0.1);
  train::FusedAdamW fused(ours, options);
  std::vector<at::Tensor> exp_avgs, exp_avg_sqs, steps;
  for (const auto& p : reference) {
    exp_avgs.push_back(torch::zeros_like(p));
    exp_avg_sqs.push_back(torch::zeros_like(p));
    steps.push_back(torch::zeros({}, on_device(torch::kFloat)));
  }
  for (int step = 0; step < 3; ++step) {
    const bool divided = step != 1;
    const at::Tensor divisor = torch::full({}, 2.5, on_device(torch::kFloat));
    std::vector<at::Tensor> reference_grads;
    for (size_t i = 0; i < sizes.size(); ++i) {
      auto storage = torch::randn({sizes[i] + 1}, on_device(grad_dtype));
      ours[i].mutable_grad() = i == 5 ? storage.narrow(0, 1, sizes[i]) : storage.narrow(0, 0, sizes[i]);
      reference_grads.push_back(ours[i].grad().to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true));
    }
    fused.step_with_grad_divisor(divided ? divisor : at::Tensor());
    at::_foreach_add_(steps, 1);
    at::_fused_adamw_(reference, reference_grads, exp_avgs, exp_avg_sqs, {}, steps, 3e-2, 0.9, 0.95, 0.1, 1e-8,
                      false, false, divided ? std::optional(divisor) : std::nullopt);
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto& state = static_cast<const train::FusedAdamWState&>(*fused.state().at(ours[i].unsafeGetTensorImpl()));
    const std::string what = "tensor " + std::to_string(i) + " of " + std::to_string(sizes[i]) + ", " +
                             c10::toString(grad_dtype) + " gradients";
    expect_close(ours[i], reference[i], 4e-7, "parameter, " + what);
    expect_close(state.exp_avg, exp_avgs[i], 4e-7, "exp_avg, " + what);
    expect_close(state.exp_avg_sq, exp_avg_sqs[i], 4e-7, "exp_avg_sq, " + what);
    EXPECT_EQ(state.step.item<float>(), 3.0f) << what;
  }
}

TEST(TrainerGpu, FusedAdamWKernelMatchesAtensFusedAdamW) {
  ASSERT_TRUE(model::have_fused_kernels()) << "this GPU build was made without the fused kernels (no nvcc?)";
  expect_adamw_kernel_matches_atens(torch::kFloat);
  expect_adamw_kernel_matches_atens(torch::kBFloat16);
}

// Under ShardOptions::keep_compute_shards the kernel writes each parameter's kept bf16 copy as it
// steps (on one GPU the copy is the unsharded parameters' storage): after each step the copy is
// the float32 parameter cast, bit for bit, and a forward computes with it.
TEST(TrainerGpu, FusedAdamWWritesTheKeptComputeShards) {
  static const auto world = fsdp::init();  // one rank
  torch::manual_seed(3);
  torch::nn::Linear linear(torch::nn::LinearOptions(70, 33));  // 33 x 70 and 33: the kernel's tails
  linear->to(at::kCUDA);
  ShardOptions o;
  o.mixed_precision.param_dtype = at::kBFloat16;
  o.keep_compute_shards = true;
  fully_shard(linear, o);
  train::FusedAdamW adam(linear->parameters(), torch::optim::AdamWOptions(3e-2).weight_decay(0.1));
  adam.init_state();
  for (int step = 0; step < 3; ++step) {
    for (auto& p : linear->parameters()) p.mutable_grad() = torch::randn(p.sizes(), on_device());
    adam.step();
    for (const auto& p : linear->parameters())
      EXPECT_TRUE(at::equal(compute_shard_of(p), p.to(at::kBFloat16))) << "step " << step << ", " << p.sizes();
  }
  const at::Tensor x = torch::randn({5, 70}, on_device(torch::kBFloat16));
  c10::NoGradGuard no_grad;
  const at::Tensor expected =
      at::linear(x, linear->weight.to(at::kBFloat16), linear->bias.to(at::kBFloat16));  // the float32 shards, cast
  EXPECT_TRUE(at::equal(fsdp::forward(linear, x), expected));
}

// The loss tests' inputs: hidden [1000, 64] (requiring gradients), weight [vocab, 64] ~ N(0,
// weight_scale^2) and targets, in float32 and bf16, for an odd vocabulary (the kernel's
// one-element path) and a multiple of 8 (its 16-byte one).
template <class F>
void for_each_loss_case(double weight_scale, F&& check) {
  const int64_t rows = 1000, dim = 64;
  for (int64_t vocab : {3001, 3008})
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      auto hidden = torch::randn({rows, dim}, on_device(dtype)).requires_grad_();
      auto weight = (torch::randn({vocab, dim}, on_device(dtype)) * weight_scale).requires_grad_();
      auto targets = torch::randint(0, vocab, {rows}, on_device(torch::kLong));
      check(rows, vocab, dtype, hidden, weight, targets);
    }
}

// The chunked output projection + loss on the GPU: float32 within float32 summation error of
// logits + cross_entropy; bf16 logits may differ by an ulp where cuBLAS picks another kernel
// for a chunk's row count, which moves a mean loss of ~ln(vocab) by far less than 1e-3.
TEST(TrainerGpu, LinearCrossEntropyMatchesLogitsThenCrossEntropy) {
  for_each_loss_case(0.1, [](int64_t rows, int64_t vocab, torch::Dtype dtype, at::Tensor hidden, at::Tensor weight,
                             at::Tensor targets) {
    auto fused = model::linear_cross_entropy(hidden, weight, targets, /*chunk_bytes=*/300 * vocab * 4);
    auto fused_grads = torch::autograd::grad({fused}, {hidden, weight});
    auto plain = torch::nn::functional::cross_entropy(torch::mm(hidden, weight.t()).to(torch::kFloat), targets);
    auto plain_grads = torch::autograd::grad({plain}, {hidden, weight});
    const bool bf16 = dtype == torch::kBFloat16;
    EXPECT_NEAR(fused.item<double>(), plain.item<double>(), (bf16 ? 1e-3 : 1e-5) * plain.item<double>());
    for (int i = 0; i < 2; ++i) {
      const double error = (fused_grads[i].to(torch::kDouble) - plain_grads[i].to(torch::kDouble)).norm().item<double>();
      EXPECT_LE(error, (bf16 ? 1e-2 : 1e-5) * plain_grads[i].to(torch::kDouble).norm().item<double>())
          << (i ? "weight" : "hidden") << " gradient, " << c10::toString(dtype) << ", vocab " << vocab;
    }
    targets[7] = vocab;  // outside the vocabulary: a NaN loss, not a device assert
    EXPECT_TRUE(std::isnan(model::linear_cross_entropy(hidden, weight, targets).item<double>()));
  });
}

// The kernel against the ATen operations it replaced, on the same logits (one chunk, so the
// same GEMMs before and after): the float32 arithmetic is the same but for the order in which
// exp is summed, so the loss agrees to float32 rounding and the gradient's elements to their last
// bit but where a sum differing in its last bits moves one across a rounding boundary. A bias in
// the gradient of 0.1% would show as 1e-3 here.
TEST(TrainerGpu, CrossEntropyKernelMatchesTheAtenOperationsOnTheSameLogits) {
  for_each_loss_case(0.3, [](int64_t rows, int64_t vocab, torch::Dtype dtype, at::Tensor hidden, at::Tensor weight,
                             at::Tensor targets) {
    auto fused = model::linear_cross_entropy(hidden, weight, targets, /*chunk_bytes=*/2 * rows * vocab * 4);
    auto fused_grads = torch::autograd::grad({fused}, {hidden, weight});
    torch::NoGradGuard no_grad;
    auto x = torch::mm(hidden, weight.t()).to(torch::kFloat);
    auto max = x.amax(1, true);
    auto e = (x - max).exp();
    auto sum = e.sum(1, true);
    auto loss = (sum.log() - (x.gather(1, targets.unsqueeze(1)) - max)).sum() / rows;
    auto grad_logits = (e / (sum * rows))
                           .scatter_add(1, targets.unsqueeze(1), torch::full({rows, 1}, -1.0 / rows, on_device()))
                           .to(dtype);
    // The products as linear_cross_entropy makes them (an addmm into zeros for the weight's).
    const std::vector<at::Tensor> want = {torch::mm(grad_logits, weight),
                                          torch::zeros_like(weight).addmm_(grad_logits.t(), hidden)};
    const std::string what = std::string(c10::toString(dtype)) + ", vocab " + std::to_string(vocab);
    EXPECT_NEAR(fused.item<double>(), loss.item<double>(), 1e-6 * loss.item<double>()) << what;
    for (int i = 0; i < 2; ++i) {
      const auto got = fused_grads[i].to(torch::kDouble), expected = want[i].to(torch::kDouble);
      const double relative = ((got - expected).norm() / expected.norm()).item<double>();
      std::cout << "cross-entropy kernel against ATen, " << what << ", " << (i ? "weight" : "hidden")
                << " gradient: relative L2 difference " << relative << "\n";
      EXPECT_LE(relative, dtype == torch::kFloat ? 1e-6 : 1e-3) << (i ? "weight" : "hidden") << " gradient, " << what;
    }
  });
}

// FlashAttention when asked for, in bf16, against ATen's choice (cuDNN on Hopper). Both keep the
// scores and the softmax in float32 and round the probabilities and the output to bf16, in
// different blockings: a relative error of a few 2^-8 in norm, below 2e-2. Where flash does not
// apply (grouped-query heads) the result is ATen's, bit for bit.
TEST(TrainerGpu, FlashAttentionIsTakenWhereItAppliesAndMatchesAtensChoice) {
  using model::AttentionKernel;
  const int64_t b = 2, heads = 4, t = 37;
  auto inputs = [&](int64_t kv_heads, int64_t d) {  // [b, heads, t, d] views of [b, t, heads, d], as the model's
    std::vector<torch::Tensor> qkv;
    for (int64_t h : {heads, kv_heads, kv_heads})
      qkv.push_back(torch::randn({b, t, h, d}, on_device(torch::kBFloat16)).requires_grad_());
    return qkv;
  };
  auto attend = [](const std::vector<torch::Tensor>& qkv, AttentionKernel kernel) {
    return model::causal_attention(qkv[0].transpose(1, 2), qkv[1].transpose(1, 2), qkv[2].transpose(1, 2), kernel);
  };
  auto relative_error = [](const torch::Tensor& got, const torch::Tensor& expected) {
    const auto e = expected.to(torch::kDouble);
    return (got.to(torch::kDouble) - e).norm().item<double>() / e.norm().item<double>();
  };
  const auto qkv = inputs(heads, 64);
  const auto flash = attend(qkv, AttentionKernel::Flash), aten = attend(qkv, AttentionKernel::Aten);
  EXPECT_THAT(flash.grad_fn()->name(), ::testing::HasSubstr("FlashAttention"));
  const auto grad = torch::randn_like(flash);
  const auto flash_grads = torch::autograd::grad({flash}, qkv, {grad});
  const auto aten_grads = torch::autograd::grad({aten}, qkv, {grad});
  EXPECT_LE(relative_error(flash, aten), 2e-2);
  for (int i = 0; i < 3; ++i) EXPECT_LE(relative_error(flash_grads[i], aten_grads[i]), 2e-2) << "q, k, v"[3 * i];
  const auto grouped = inputs(2, 64);
  EXPECT_TRUE(torch::equal(attend(grouped, AttentionKernel::Flash), attend(grouped, AttentionKernel::Aten)));
}

// Packed documents in bf16 take FlashAttention-2's variable-length kernel (grouped k/v heads
// included), and give what the mask path gives in float32 on the same inputs: bf16's rounding of
// the probabilities and the output, a relative error of a few 2^-8 in norm, below 2e-2; so do the
// gradients. Documents of 1 to 20 tokens, some ending with their row.
TEST(TrainerGpu, PackedDocumentsTakeFlashAttentionsVariableLengthKernel) {
  const int64_t b = 2, heads = 4, kv_heads = 2, t = 37, d = 64;
  std::vector<torch::Tensor> qkv;
  for (int64_t h : {heads, kv_heads, kv_heads})
    qkv.push_back(torch::randn({b, t, h, d}, on_device(torch::kBFloat16)).requires_grad_());
  const auto offsets = torch::tensor({0, 1, 21, 30, 37, 40, 60, 74}, on_device(torch::kInt));
  auto attend = [&](const std::vector<torch::Tensor>& x) {
    return model::causal_attention(x[0].transpose(1, 2), x[1].transpose(1, 2), x[2].transpose(1, 2),
                                   model::AttentionKernel::Aten, offsets);
  };
  const auto flash = attend(qkv);
  std::string made_by;  // the kernel's node, under the views back to [b, heads, t, d]
  for (auto fn = flash.grad_fn(); fn; fn = fn->next_edges().empty() ? nullptr : fn->next_edge(0).function)
    made_by += fn->name() + " ";
  EXPECT_THAT(made_by, ::testing::HasSubstr("FlashAttentionBackward"));
  std::vector<torch::Tensor> wide;
  for (const auto& x : qkv) wide.push_back(x.detach().to(torch::kFloat).requires_grad_());
  const auto masked = attend(wide);
  const auto grad = torch::randn_like(flash);
  const auto flash_grads = torch::autograd::grad({flash}, qkv, {grad});
  const auto masked_grads = torch::autograd::grad({masked}, wide, {grad.to(torch::kFloat)});
  auto relative_error = [](const torch::Tensor& got, const torch::Tensor& expected) {
    const auto e = expected.to(torch::kDouble);
    return (got.to(torch::kDouble) - e).norm().item<double>() / e.norm().item<double>();
  };
  EXPECT_LE(relative_error(flash, masked), 2e-2);
  for (int i = 0; i < 3; ++i) EXPECT_LE(relative_error(flash_grads[i], masked_grads[i]), 2e-2) << "q, k, v"[3 * i];
}

}  // namespace
}  // namespace fsdp
