// Training batches that do not depend on the number of ranks: step s always
// yields the same global batch, and each rank takes its rows of it.
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
  // [rows, seq + 1] int64 tokens: rows [first_row, first_row + rows) of the
  // global batch of `step`. Inputs are [:, :-1], targets [:, 1:].
  virtual at::Tensor rows(int64_t step, int64_t first_row, int64_t rows, int64_t seq) const = 0;
};

// Learnable synthetic sequences: each row counts up from a random start with
// a random stride of 1 to 4 modulo vocab. Once the model reads the stride off
// the context the next token is determined, so the loss falls from
// log(vocab) towards zero within tens of steps.
std::unique_ptr<TokenSource> synthetic_tokens(int64_t vocab, uint64_t seed);
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

// Random windows of a token file (see TokenFileLayout), memory-mapped: each rank reads only the
// pages of its rows.
std::unique_ptr<TokenSource> file_tokens(const std::string& path, uint64_t seed);

}  // namespace fsdp::train
