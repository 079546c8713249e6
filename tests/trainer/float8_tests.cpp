// Float8 linears' arithmetic on CPU (fsdp/float8.h): the casts' scales, rounding and saturation,
// and the linear's three GEMMs against float64 products within bounds derived from the formats'
// precision. The GPU suite checks that the CUDA casts equal these bit for bit and _scaled_mm the
// dequantised products (tests/lib/gpu_tests.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <vector>

#include "fsdp/float8.h"
#include "model/llama.h"

namespace {

using namespace fsdp;
using namespace fsdp::model;

// Rounding to nearest with m mantissa bits moves a normal value by at most 2^-(m+1) of itself;
// below the smallest normal (2^-6 for e4m3, 2^-14 for e5m2) by at most half the subnormal spacing
// (2^-10, 2^-17). In units of the scaled value; divided by the scale for the original's.
struct FormatBounds {
  double relative, absolute;
};
FormatBounds bounds_of(Float8Format f) { return f == Float8Format::E4M3 ? FormatBounds{0x1p-4, 0x1p-10} : FormatBounds{0x1p-3, 0x1p-17}; }

torch::Tensor dequantised(const Float8Operand& op) {
  const auto scale = op.inverse_scale.dim() == 0 ? op.inverse_scale : op.inverse_scale.unsqueeze(1);
  return op.data.to(torch::kDouble) * scale.to(torch::kDouble);
}

// The largest error the cast may make on each element of `operand` (x or x^T, as op.data).
torch::Tensor cast_error_bound(const torch::Tensor& operand, const Float8Operand& op, Float8Format f) {
  const auto b = bounds_of(f);
  const auto inverse = op.inverse_scale.dim() == 0 ? op.inverse_scale : op.inverse_scale.unsqueeze(1);
  return operand.abs().to(torch::kDouble) * b.relative + inverse.to(torch::kDouble) * b.absolute;
}

TEST(Float8Cast, ScalesArePowersOfTwoThatFitTheAmaxUnderTheFormatsMax) {
  torch::manual_seed(0);
  auto x = torch::randn({12, 32}) * torch::logspace(-3, 3, 12).unsqueeze(1);  // rows of very different sizes
  for (auto f : {Float8Format::E4M3, Float8Format::E5M2})
    for (bool per_row : {false, true})
      for (bool transposed : {false, true}) {
        const auto op = to_float8(x, f, per_row, transposed);
        const auto operand = transposed ? x.t() : x;
        EXPECT_EQ(op.data.sizes(), operand.sizes());
        EXPECT_TRUE(op.data.is_contiguous());
        const auto amax = per_row ? operand.abs().amax(1) : operand.abs().max();
        EXPECT_TRUE(torch::equal(float8_amax(x, per_row, transposed), amax));
        const auto scale = op.inverse_scale.reciprocal().to(torch::kDouble);
        const auto exponent = scale.log2();
        EXPECT_TRUE(torch::equal(exponent, exponent.round())) << "scales are powers of two";
        const auto fitted = amax.to(torch::kDouble) * scale;  // in (max / 2, max]
        EXPECT_TRUE((fitted <= max_of(f)).all().item<bool>());
        EXPECT_TRUE((fitted > max_of(f) / 2).all().item<bool>());
        const auto error = (dequantised(op) - operand.to(torch::kDouble)).abs();
        EXPECT_TRUE((error <= cast_error_bound(operand, op, f)).all().item<bool>())
            << "format " << int(f) << " per_row " << per_row << " transposed " << transposed;
      }
}

TEST(Float8Cast, BothLayoutsAtOnceAreTheTwoCastsWithOneScale) {
  const auto x = torch::randn({20, 48}).to(torch::kBFloat16);
  for (auto f : {Float8Format::E4M3, Float8Format::E5M2}) {
    const auto both = to_float8_both(x, f);
    for (bool transposed : {false, true}) {
      const auto& got = transposed ? both.transposed : both.plain;
      const auto want = to_float8(x, f, false, transposed);
      EXPECT_TRUE(torch::equal(got.data.view(torch::kUInt8), want.data.view(torch::kUInt8)));
      EXPECT_TRUE(torch::equal(got.inverse_scale, want.inverse_scale));
    }
  }
}

TEST(Float8Cast, PerRowScalesKeepSmallRowsPreciseWhereOneScaleFlushesThem) {
  auto x = torch::full({2, 16}, 1e-3);
  x[0] = 1000.0;  // one outlier row: one scale for both leaves the small row far below e4m3's normals
  const auto whole = dequantised(to_float8(x, Float8Format::E4M3, false, false));
  const auto rows = dequantised(to_float8(x, Float8Format::E4M3, true, false));
  const double want = x[1][0].item<double>();
  EXPECT_GT(std::abs(whole[1][0].item<double>() - want), 0.1 * want);  // 1e-3 in 2^-15-sized steps
  EXPECT_LE(std::abs(rows[1][0].item<double>() - want), 0x1p-4 * want);
}

TEST(Float8Cast, ValuesBeyondAPassedAmaxSaturateAtTheMaxAndZerosStayZero) {
  const auto x = torch::tensor({{1000.0f, -1000.0f, 0.5f, 0.0f}}).repeat({1, 4});
  for (auto f : {Float8Format::E4M3, Float8Format::E5M2}) {
    // amax 1 (stale, as a saved amax may be): the scale is 256 or 32768, so 1000 lands far beyond the max.
    const auto op = to_float8(x, f, false, false, torch::tensor(1.0f));
    const auto values = op.data.to(torch::kFloat);
    EXPECT_EQ(values[0][0].item<float>(), max_of(f));
    EXPECT_EQ(values[0][1].item<float>(), -max_of(f));
    EXPECT_TRUE(torch::isfinite(values).all().item<bool>());
    EXPECT_EQ(values[0][3].item<float>(), 0.0f);
  }
  const auto zeros = to_float8(torch::zeros({3, 16}), Float8Format::E4M3, true, false);
  EXPECT_TRUE(torch::isfinite(zeros.inverse_scale).all().item<bool>());
  EXPECT_EQ(zeros.data.to(torch::kFloat).abs().sum().item<float>(), 0.0f);
}

// |x~ w~ - x w| <= |x~ - x| |w~| + |x| |w~ - w| term by term, so the float64 product of the
// dequantised operands is within (bound_x @ |w~|^T + |x| @ bound_w^T) of x @ w^T; float32
// accumulation (the CPU path) and the output's rounding add at most 1e-5 of |x| @ |w|^T here.
void expect_product_within_bound(const torch::Tensor& got, const torch::Tensor& a, const torch::Tensor& b,
                                 Float8Format fa, Float8Format fb, bool per_row, const char* what) {
  const auto qa = to_float8(a, fa, per_row, false), qb = to_float8(b, fb, per_row, false);
  const auto a64 = a.to(torch::kDouble), b64 = b.to(torch::kDouble);
  const auto bound = torch::mm(cast_error_bound(a, qa, fa), dequantised(qb).abs().t()) +
                     torch::mm(a64.abs(), cast_error_bound(b, qb, fb).t()) +
                     1e-5 * torch::mm(a64.abs(), b64.abs().t());
  const auto error = (got.to(torch::kDouble) - torch::mm(a64, b64.t())).abs();
  EXPECT_TRUE((error <= bound).all().item<bool>()) << what << ": worst excess " << (error - bound).max().item<double>();
  // And the bound is not vacuous: float8 moves the product by far less than its size.
  EXPECT_LT((bound / torch::mm(a64.abs(), b64.abs().t())).max().item<double>(), 0.3) << what;
}

TEST(Float8Linear, ForwardAndBothGradientsAreFloat8ProductsWithinTheFormatsBounds) {
  torch::manual_seed(1);
  const int64_t batch = 2, seq = 8, in = 48, out = 32;
  for (auto recipe : {Float8Recipe::Tensorwise, Float8Recipe::Rowwise}) {
    const bool rowwise = recipe == Float8Recipe::Rowwise;
    auto x = torch::randn({batch, seq, in}).requires_grad_();
    auto w = (torch::randn({out, in}) * 0.1).requires_grad_();
    const auto g = torch::randn({batch, seq, out});
    auto y = float8_linear(x, w, recipe);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{batch, seq, out}));
    y.backward(g);
    const auto x2 = x.detach().reshape({-1, in}), g2 = g.reshape({-1, out});
    const auto g_format = rowwise ? Float8Format::E4M3 : Float8Format::E5M2;
    expect_product_within_bound(y.detach().reshape({-1, out}), x2, w.detach(), Float8Format::E4M3,
                                Float8Format::E4M3, rowwise, "y = x w^T");
    // grad_x = g @ w = g @ (w^T)^T;  grad_w = g^T @ x = g^T @ (x^T)^T.
    expect_product_within_bound(x.grad().reshape({-1, in}), g2, w.detach().t(), g_format, Float8Format::E4M3,
                                rowwise, "grad_x = g w");
    expect_product_within_bound(w.grad(), g2.t(), x2.t(), g_format, Float8Format::E4M3, rowwise, "grad_w = g^T x");
  }
}

// Why rowwise exists: on activations with a few outlier features and gradients whose size varies
// from token to token (as in LLM training), one scale per tensor leaves most rows far below the
// format's range, and the gradient GEMMs lose precision that per-row scales keep. Relative
// errors in norm; rowwise's stay near e4m3's rounding, tensorwise's gradients lose more.
TEST(Float8Linear, RowwiseGradientsAreMoreAccurateThanTensorwiseOnOutliersAndVaryingScales) {
  torch::manual_seed(3);
  const int64_t tokens = 512, in = 256, out = 256;
  auto x = torch::randn({tokens, in});
  x.narrow(1, 0, 4).mul_(20);  // outlier features
  const auto w = torch::randn({out, in}) * 0.02;
  const auto g = torch::randn({tokens, out}) * torch::randn({tokens, 1}).exp() * 1e-4;
  std::map<Float8Recipe, std::vector<double>> errors;
  for (auto recipe : {Float8Recipe::Tensorwise, Float8Recipe::Rowwise}) {
    auto xr = x.clone().requires_grad_(), wr = w.clone().requires_grad_();
    auto y = float8_linear(xr, wr, recipe);
    y.backward(g);
    auto relative = [](const torch::Tensor& got, const torch::Tensor& want) {
      return ((got - want).norm() / want.norm()).item<double>();
    };
    errors[recipe] = {relative(y.detach(), torch::mm(x, w.t())), relative(xr.grad(), torch::mm(g, w)),
                      relative(wr.grad(), torch::mm(g.t(), x))};
  }
  const auto &tensorwise = errors[Float8Recipe::Tensorwise], &rowwise = errors[Float8Recipe::Rowwise];
  for (int i = 1; i < 3; ++i) {  // the gradients
    EXPECT_LT(rowwise[i], 0.8 * tensorwise[i]) << "grad_x / grad_w " << i;
    EXPECT_LT(rowwise[i], 0.06) << i;  // e4m3's 2^-4 bound, averaged over random rounding
  }
  EXPECT_LT(rowwise[0], 0.06);
}

TEST(Float8Linear, BadShapesRecipesAndNamesAreRefusedClearly) {
  EXPECT_THROW(float8_linear(torch::randn({4, 8}), torch::randn({8, 16}), Float8Recipe::Tensorwise),
               std::invalid_argument);
  EXPECT_THROW(float8_linear(torch::randn({4, 8}), torch::randn({16, 8}), Float8Recipe::Off), std::invalid_argument);
  EXPECT_EQ(float8_recipe_named("rowwise"), Float8Recipe::Rowwise);
  try {
    float8_recipe_named("e4m3");
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "float8 recipe must be off, tensorwise or rowwise, not 'e4m3'");
  }
}

// The Llama's block projections run in float8 when asked, the head and embedding never: the
// loss moves by float8's rounding only, and every parameter still gets a gradient.
TEST(Float8Linear, LlamaBlocksInFloat8GiveALossNearTheExactOne) {
  LlamaConfig c;
  c.dim = 64, c.ffn = 176, c.vocab = 256;
  const auto tokens = torch::randint(0, c.vocab, {2, 16}, torch::Generator(at::detail::createCPUGenerator(5)));
  const auto targets = tokens.roll(1, 1);
  Llama exact(c);
  c.float8 = Float8Recipe::Rowwise;
  Llama float8(c);  // the same seed: the same weights
  const double want = exact->forward(tokens, targets).item<double>();
  auto loss = float8->forward(tokens, targets);
  EXPECT_NE(loss.item<double>(), want);
  EXPECT_NEAR(loss.item<double>(), want, 0.02 * want);
  loss.backward();
  for (const auto& p : float8->named_parameters())
    EXPECT_TRUE(p.value().grad().defined() && p.value().grad().abs().sum().item<double>() > 0) << p.key();
}

}  // namespace
