// Held-out loss: the same fixed set of sequences whatever the number of ranks, split across them.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

#include "fsdp/communicator.h"
#include "model/llama.h"
#include "train/data.h"

namespace fsdp::train {

struct EvalResult {
  double loss = 0;        // mean cross-entropy per predicted token
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // predicted tokens in the set
};

// Collective. The mean loss of `model` over `data`'s samples [0, rows), batch rows per forward on every data-parallel rank (`me`): each rank runs the same
// number of forward passes (collectives match) and counts only the rows that fall inside the set.
EvalResult evaluate(model::Llama& model, Communicator& comm, const DataRank& me, const TokenSource& data,
                    int64_t rows, int64_t batch);

}  // namespace fsdp::train
