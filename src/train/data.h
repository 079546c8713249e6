// Training batches that do not depend on the number of ranks: step s always
// yields the same global batch, and each rank takes its rows of it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::train {

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
// Random windows of a file's bytes (tokens 0..255; needs vocab >= 256).
std::unique_ptr<TokenSource> file_tokens(const std::string& path, uint64_t seed);

}  // namespace fsdp::train
