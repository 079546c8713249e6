#include "shard/flat_copy.h"

#include <ATen/ops/_chunk_cat.h>
#include <ATen/ops/_foreach_copy.h>

namespace fsdp {

void rank_major_into(at::Tensor& out, const std::vector<at::Tensor>& rows) {
  std::vector<at::Tensor> inputs;
  for (const auto& t : rows)  // empty tensors have no rows to place (and _chunk_cat refuses them)
    if (t.numel() > 0) inputs.push_back(t.dim() == 0 ? t.reshape({1}) : t.contiguous());
  if (inputs.empty()) return;
  if (out.size(0) > 1) {
    at::_chunk_cat_out(out, inputs, /*dim=*/0, /*num_chunks=*/out.size(0));
    return;
  }
  // One rank: no rows to pad or interleave, so the layout is the tensors one after another. A
  // multi-tensor copy into out's consecutive pieces casts at 2.7x _chunk_cat's speed (bf16 into
  // float32 on an H200: 3.2 against 1.2 TB/s).
  std::vector<int64_t> sizes;
  std::vector<at::Tensor> flat;
  for (const auto& t : inputs) {
    sizes.push_back(t.numel());
    flat.push_back(t.view(-1));
  }
  at::_foreach_copy_(out.view(-1).split_with_sizes(sizes), flat);
}

}  // namespace fsdp
