#include "train/data.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/randint.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <stdexcept>

#include "io/files.h"

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

uint32_t read_le32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

uint64_t token_at(const uint8_t* tokens, int width, uint64_t i) {
  const uint8_t* p = tokens + i * width;
  switch (width) {
    case 1: return p[0];
    case 2: return uint64_t(p[0]) | uint64_t(p[1]) << 8;
    default: return read_le32(p);
  }
}

// A plain loop the compiler vectorises: a pass over a GB-sized file takes a fraction of a second.
template <class T>
uint64_t largest_of(const uint8_t* data, uint64_t count) {
  const T* ids = reinterpret_cast<const T*>(data);
  T largest = 0;
  for (uint64_t i = 0; i < count; ++i) largest = std::max(largest, ids[i]);
  return largest;
}

class FileTokens : public TokenSource {
 public:
  FileTokens(const std::string& path, uint64_t seed)
      : file_(path), layout_(token_file_layout(path, file_.data(), file_.size())), seed_(seed) {}
  at::Tensor rows(int64_t step, int64_t first_row, int64_t rows, int64_t seq) const override {
    const int64_t n = static_cast<int64_t>(layout_.tokens);
    if (n < seq + 2)
      throw std::invalid_argument("data file '" + file_.path() + "' has " + std::to_string(n) +
                                  " tokens; sequence length " + std::to_string(seq) +
                                  " needs at least " + std::to_string(seq + 2));
    const uint8_t* tokens = file_.data() + layout_.header_bytes;
    at::Tensor out = at::empty({rows, seq + 1}, at::kLong);
    auto* dst = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      auto gen = row_generator(seed_, step, first_row + r);
      const int64_t start = at::randint(0, n - seq - 1, {1}, gen, at::kLong).item<int64_t>();
      for (int64_t i = 0; i <= seq; ++i)
        dst[r * (seq + 1) + i] = static_cast<int64_t>(token_at(tokens, layout_.width, start + i));
    }
    return out;
  }

 private:
  io::MappedFile file_;
  TokenFileLayout layout_;
  uint64_t seed_;
};

}  // namespace

std::unique_ptr<TokenSource> synthetic_tokens(int64_t vocab, uint64_t seed) {
  return std::make_unique<SyntheticTokens>(vocab, seed);
}

TokenFileLayout token_file_layout(const std::string& path, const uint8_t* data, uint64_t size) {
  const bool ends_bin = path.size() >= 4 && path.compare(path.size() - 4, 4, ".bin") == 0;
  if (!ends_bin) return {"bytes", 0, 1, size};
  constexpr uint32_t kLlmcUint16 = 20240520, kLlmcUint32 = 20240801;
  constexpr uint64_t kHeader = 256 * 4;
  const uint32_t magic = size >= kHeader ? read_le32(data) : 0;
  if (magic == kLlmcUint16 || magic == kLlmcUint32) {
    const int width = magic == kLlmcUint16 ? 2 : 4;
    const uint64_t tokens = read_le32(data + 8);
    const uint64_t expected = kHeader + tokens * width;
    if (expected != size)
      throw std::invalid_argument("'" + path + "': its llm.c header says " + std::to_string(tokens) + " tokens of " +
                                  std::to_string(width) + " bytes (" + std::to_string(expected) +
                                  " bytes with the header) but the file has " + std::to_string(size) +
                                  " bytes: a truncated or damaged file");
    return {width == 2 ? "llm.c uint16" : "llm.c uint32", kHeader, width, tokens};
  }
  if (size % 2 != 0)
    throw std::invalid_argument("'" + path + "' has no llm.c header (magic 20240520 or 20240801) and an odd size (" +
                                std::to_string(size) + " bytes), so it is not nanoGPT's uint16 ids either");
  return {"nanoGPT uint16", 0, 2, size / 2};
}

uint64_t largest_token(const uint8_t* data, const TokenFileLayout& layout) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian");
  const uint8_t* tokens = data + layout.header_bytes;  // page-aligned mapping + 1024: aligned for T
  switch (layout.width) {
    case 1: return largest_of<uint8_t>(tokens, layout.tokens);
    case 2: return largest_of<uint16_t>(tokens, layout.tokens);
    default: return largest_of<uint32_t>(tokens, layout.tokens);
  }
}

std::unique_ptr<TokenSource> file_tokens(const std::string& path, uint64_t seed) {
  return std::make_unique<FileTokens>(path, seed);
}

}  // namespace fsdp::train
