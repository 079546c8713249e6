#include "shard/flat_copy.h"

#include <ATen/ops/_chunk_cat.h>

namespace fsdp {

void rank_major_into(at::Tensor& out, const std::vector<at::Tensor>& rows) {
  std::vector<at::Tensor> inputs;
  for (const auto& t : rows)  // empty tensors have no rows to place (and _chunk_cat refuses them)
    if (t.numel() > 0) inputs.push_back(t.dim() == 0 ? t.reshape({1}) : t.contiguous());
  if (!inputs.empty()) at::_chunk_cat_out(out, inputs, /*dim=*/0, /*num_chunks=*/out.size(0));
}

}  // namespace fsdp
