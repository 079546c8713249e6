// The output projection and the cross-entropy loss in one differentiable operation that never
// holds the [rows, vocab] logits: the rows go through in chunks, and since the loss is the last
// operation of a step, each chunk's gradients are computed in the forward, while its logits are
// at hand (no second projection in the backward).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "fsdp/communicator.h"

namespace fsdp::model {

// The mean over rows of -log softmax(hidden @ weight^T)[target], in float32 (float64 for float64
// inputs).
// hidden [rows, dim] and weight [vocab, dim] of one dtype, targets [rows] int64 in [0, vocab).
// Each chunk's float32 logits take at most `chunk_bytes` (at least one row; on GPUs a kernel
// reads the chunk's logits in their own dtype, makes no float32 copy, and gives a target outside
// [0, vocab) a NaN loss rather than a device assert). The gradients
// (hidden's [rows, dim] and weight's [vocab, dim], in their dtype) are made only where grad mode
// is on and an input requires them; they live from the forward to the backward.
// With `tp` (tensor parallelism), weight is this tp rank's part of the vocabulary (rows
// [rank * n, (rank + 1) * n) of the full head), hidden every token, and the loss the same on every
// tp rank: each chunk's max, sum of exponentials and target logit are combined over the tp ranks
// (the unfused path, on GPUs too). hidden's gradient is then this rank's part of the sum, to be
// summed over the tp ranks (fsdp::tp::gather_rows' backward does).
constexpr int64_t kLossChunkBytes = int64_t(256) << 20;
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                int64_t chunk_bytes = kLossChunkBytes, Communicator* tp = nullptr);

}  // namespace fsdp::model
