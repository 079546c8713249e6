// A tensor over another's memory that is not an autograd view of it (no copy is made). The
// reduce-scatter hands such tensors out as gradients, since optimizers call detach_() on gradients
// (zero_grad) and views refuse it; the Gloo backend gives them to its worker thread, whose drop of
// a view could reach a tensor Python owns and so need the GIL (src/comm/README.md).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace fsdp {

inline at::Tensor alias_without_view(const at::Tensor& view) {
  return at::empty({0}, view.options()).set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
}

}  // namespace fsdp
