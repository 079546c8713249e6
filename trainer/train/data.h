// Training sequences that do not depend on the number of ranks or the batch: sample n is the
// run's n-th sequence, whoever reads it; the trainer maps (step, row) to samples.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::train {

// Which rows of a step's global batch a rank takes: those of its data-parallel index (the tp
// ranks that split one model share theirs), and whether it counts them where every rank's
// numbers are summed (one rank of each tp group does).
struct DataRank {
  int index = 0;  // among the data-parallel ranks
  int count = 1;  // data-parallel ranks: world / tp
  bool counts = true;
};

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // [count, seq + 1] int64 tokens: samples [first, first + count). Inputs are [:, :-1], targets
  // [:, 1:].
  virtual at::Tensor samples(int64_t first, int64_t count) const = 0;
  // Samples in one pass over the data (an epoch); 0 for a source without end.
  virtual int64_t epoch_samples() const = 0;
};

// Learnable synthetic sequences of seq + 1 tokens: each counts up from a random start with a
// random stride of 1 to 4 modulo vocab. Once the model reads the stride off the context the next
// token is determined, so the loss falls from log(vocab) towards zero within tens of steps.
std::unique_ptr<TokenSource> synthetic_tokens(int64_t vocab, int64_t seq, uint64_t seed);

// How a --data file holds its tokens. A file ending in .bin holds token ids: with llm.c's header
// (256 int32: magic 20240520 for uint16 ids or 20240801 for uint32 ids, version, token count;
// then the ids) or without one, nanoGPT's layout (uint16 ids only). Any other file is text,
// one token per byte.
struct TokenFileLayout {
  std::string format;         // "llm.c uint16", "llm.c uint32", "nanoGPT uint16" or "bytes"
  uint64_t header_bytes = 0;  // before the first token
  int width = 1;              // bytes per token
  uint64_t tokens = 0;
};
// Throws std::invalid_argument naming the file and what is wrong (a header that does not match
// the file's size, a size that is not a whole number of tokens).
TokenFileLayout token_file_layout(const std::string& path, const uint8_t* data, uint64_t size);
// The largest token id in the file (one pass over the mapped file).
uint64_t largest_token(const uint8_t* data, const TokenFileLayout& layout);

// The files of a --data path: the file itself, or a directory's *.bin files in name order (a
// corpus fsdp-prepare-data wrote in parts). Throws std::invalid_argument for a directory without
// .bin files.
std::vector<std::string> data_files(const std::string& path);

// Sequences a file of `tokens` tokens holds: windows of seq + 1 tokens, each starting where the
// last one's final token is (the target of its last position is the next window's first input).
inline int64_t windows_of(uint64_t tokens, int64_t seq) {
  return tokens > 0 ? static_cast<int64_t>((tokens - 1) / static_cast<uint64_t>(seq)) : 0;
}

// A permutation of [0, n) chosen by `key`, computed one index at a time, so nothing is held
// however large n is: a four-round Feistel network over the smallest power of four >= n, whose
// outputs that fall outside [0, n) go through it again (cycle walking: still a bijection of [0, n),
// at most four passes on average).
class Shuffle {
 public:
  Shuffle(uint64_t n, uint64_t key);
  uint64_t operator()(uint64_t i) const;

 private:
  uint64_t n_, key_;
  int half_bits_;
};

// The windows of token files (see TokenFileLayout), memory-mapped: each rank reads only the pages
// of its samples. In order: sample n is window n mod W of the files in order (W windows in all).
// Shuffled: each epoch (W samples) visits every window once, in an order the seed and the epoch's
// number choose, so a run resumed at sample n continues exactly where it stopped.
enum class SampleOrder { InOrder, Shuffled };
std::unique_ptr<TokenSource> file_tokens(const std::vector<std::string>& files, int64_t seq, uint64_t seed,
                                         SampleOrder order);

}  // namespace fsdp::train
