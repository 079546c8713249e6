#include "train/data.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <iterator>
#include <stdexcept>

#include "io/files.h"

namespace fsdp::train {
namespace {

// splitmix64's output function: a well-mixed 64-bit hash of x.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One generator per (seed, sample): a sample is the same whichever rank reads it in whichever step.
at::Generator sample_generator(uint64_t seed, int64_t sample) {
  return at::make_generator<at::CPUGeneratorImpl>(mix(seed) ^ static_cast<uint64_t>(sample));
}

class SyntheticTokens : public TokenSource {
 public:
  static constexpr int64_t kMaxStride = 4;
  SyntheticTokens(int64_t vocab, int64_t seq, uint64_t seed) : vocab_(vocab), seq_(seq), seed_(seed) {}
  at::Tensor samples(int64_t first, int64_t count) const override {
    at::Tensor out = at::empty({count, seq_ + 1}, at::kLong);
    at::Tensor positions = at::arange(seq_ + 1, at::kLong);
    for (int64_t r = 0; r < count; ++r) {
      auto gen = sample_generator(seed_, first + r);
      auto start = at::randint(0, vocab_, {1}, gen, at::kLong);
      auto stride = at::randint(1, kMaxStride + 1, {1}, gen, at::kLong);
      out[r].copy_(positions.mul(stride).add(start).remainder(vocab_));
    }
    return out;
  }
  int64_t epoch_samples() const override { return 0; }

 private:
  int64_t vocab_, seq_;
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
  FileTokens(const std::vector<std::string>& files, int64_t seq, uint64_t seed, SampleOrder order)
      : seq_(seq), seed_(seed), order_(order) {
    for (const auto& path : files) {
      auto file = std::make_unique<io::MappedFile>(path);
      const TokenFileLayout layout = token_file_layout(path, file->data(), file->size());
      parts_.push_back({std::move(file), layout, windows_});
      windows_ += windows_of(layout.tokens, seq);
    }
    if (windows_ == 0)
      throw std::invalid_argument("the data (" + files.front() + (files.size() > 1 ? " and others" : "") +
                                  ") holds no sequence of " + std::to_string(seq + 1) +
                                  " tokens (--seq + 1): lower --seq or use longer files");
  }

  at::Tensor samples(int64_t first, int64_t count) const override {
    at::Tensor out = at::empty({count, seq_ + 1}, at::kLong);
    auto* dst = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < count; ++r) {
      const int64_t sample = first + r, epoch = sample / windows_, i = sample % windows_;
      const int64_t window = order_ == SampleOrder::InOrder
                                 ? i
                                 : static_cast<int64_t>(Shuffle(windows_, mix(seed_) ^ mix(epoch))(i));
      // The part holding the window: the last whose first window is at or before it.
      const auto part = std::prev(std::upper_bound(parts_.begin(), parts_.end(), window,
                                                   [](int64_t w, const Part& p) { return w < p.first_window; }));
      const uint8_t* tokens = part->file->data() + part->layout.header_bytes;
      const uint64_t start = static_cast<uint64_t>(window - part->first_window) * seq_;
      for (int64_t t = 0; t <= seq_; ++t)
        dst[r * (seq_ + 1) + t] = static_cast<int64_t>(token_at(tokens, part->layout.width, start + t));
    }
    return out;
  }
  int64_t epoch_samples() const override { return windows_; }

 private:
  struct Part {
    std::unique_ptr<io::MappedFile> file;
    TokenFileLayout layout;
    int64_t first_window;  // of the whole corpus
  };
  std::vector<Part> parts_;
  int64_t windows_ = 0, seq_;
  uint64_t seed_;
  SampleOrder order_;
};

}  // namespace

std::unique_ptr<TokenSource> synthetic_tokens(int64_t vocab, int64_t seq, uint64_t seed) {
  return std::make_unique<SyntheticTokens>(vocab, seq, seed);
}

Shuffle::Shuffle(uint64_t n, uint64_t key) : n_(n), key_(key), half_bits_(1) {
  while (half_bits_ < 31 && (uint64_t{1} << (2 * half_bits_)) < n) ++half_bits_;
}

uint64_t Shuffle::operator()(uint64_t i) const {
  const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
  do {
    uint64_t left = i >> half_bits_, right = i & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t mixed = left ^ (mix(key_ ^ mix(right + (round << 40))) & mask);
      left = right;
      right = mixed;
    }
    i = left << half_bits_ | right;
  } while (i >= n_);
  return i;
}

std::vector<std::string> data_files(const std::string& path) {
  if (!io::is_directory(path)) return {path};
  std::vector<std::string> files;
  for (const auto& name : io::list_directory(path))
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".bin") == 0) files.push_back(path + "/" + name);
  std::sort(files.begin(), files.end());
  if (files.empty())
    throw std::invalid_argument("'" + path + "' is a directory without .bin files: give a token file, or a "
                                "directory of the .bin files fsdp-prepare-data wrote");
  return files;
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

std::unique_ptr<TokenSource> file_tokens(const std::vector<std::string>& files, int64_t seq, uint64_t seed,
                                         SampleOrder order) {
  return std::make_unique<FileTokens>(files, seq, seed, order);
}

}  // namespace fsdp::train
