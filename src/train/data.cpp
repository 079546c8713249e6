#include "train/data.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/randint.h>
#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <iterator>
#include <stdexcept>

namespace fsdp::train {
namespace {

// One generator per (seed, step, row): rows are identical however the global
// batch is split across ranks.
at::Generator row_generator(uint64_t seed, int64_t step, int64_t row) {
  return at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ull + step * 7919ull + row);
}

class SyntheticTokens : public TokenSource {
 public:
  static constexpr int64_t kMaxStride = 4;
  SyntheticTokens(int64_t vocab, uint64_t seed) : vocab_(vocab), seed_(seed) {}
  at::Tensor rows(int64_t step, int64_t first_row, int64_t rows, int64_t seq) const override {
    at::Tensor out = at::empty({rows, seq + 1}, at::kLong);
    at::Tensor positions = at::arange(seq + 1, at::kLong);
    for (int64_t r = 0; r < rows; ++r) {
      auto gen = row_generator(seed_, step, first_row + r);
      auto start = at::randint(0, vocab_, {1}, gen, at::kLong);
      auto stride = at::randint(1, kMaxStride + 1, {1}, gen, at::kLong);
      out[r].copy_(positions.mul(stride).add(start).remainder(vocab_));
    }
    return out;
  }

 private:
  int64_t vocab_;
  uint64_t seed_;
};

class FileTokens : public TokenSource {
 public:
  FileTokens(const std::string& path, uint64_t seed) : seed_(seed) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::invalid_argument("cannot read data file '" + path + "'");
    bytes_.assign(std::istreambuf_iterator<char>(in), {});
  }
  at::Tensor rows(int64_t step, int64_t first_row, int64_t rows, int64_t seq) const override {
    const int64_t n = static_cast<int64_t>(bytes_.size());
    if (n < seq + 2)
      throw std::invalid_argument("data file has " + std::to_string(n) +
                                  " bytes; sequence length " + std::to_string(seq) +
                                  " needs at least " + std::to_string(seq + 2));
    at::Tensor out = at::empty({rows, seq + 1}, at::kLong);
    auto* dst = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      auto gen = row_generator(seed_, step, first_row + r);
      int64_t start = at::randint(0, n - seq - 1, {1}, gen, at::kLong).item<int64_t>();
      for (int64_t i = 0; i <= seq; ++i)
        dst[r * (seq + 1) + i] = static_cast<unsigned char>(bytes_[start + i]);
    }
    return out;
  }

 private:
  std::vector<char> bytes_;
  uint64_t seed_;
};

}  // namespace

std::unique_ptr<TokenSource> synthetic_tokens(int64_t vocab, uint64_t seed) {
  return std::make_unique<SyntheticTokens>(vocab, seed);
}

std::unique_ptr<TokenSource> file_tokens(const std::string& path, uint64_t seed) {
  return std::make_unique<FileTokens>(path, seed);
}

}  // namespace fsdp::train
