// Activation recomputation ("activation checkpointing") for (sharded or plain) modules. Not to be
// confused with saving training state: that is fsdp/sharded_checkpoint.h.
//
//   h = fsdp::recompute(block, h, cos, sin);   // instead of fsdp::forward(block, h, cos, sin)
//
// The forward runs without keeping activations; backward runs it again with
// gradients and back-propagates through the recomputation. For a sharded
// module the recompute counts as the start of its backward: it is not a new
// step, leaves the recorded forward order alone, is prefetched in backward
// order like any other group and keeps its parameters until its gradients
// are reduce-scattered. Arguments: tensors; result: one tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/fully_shard.h"

namespace fsdp {
namespace detail {

at::Tensor recompute_impl(std::function<at::Tensor(const std::vector<at::Tensor>&)> run,
                           std::vector<at::Tensor> inputs);

template <class M, size_t... I>
at::Tensor call_with(M& module, const std::vector<at::Tensor>& in, std::index_sequence<I...>) {
  return fsdp::forward(module, in[I]...);
}

}  // namespace detail

/// Runs `module` (through fsdp::forward) without keeping its activations, and again in backward
/// to back-propagate through it. Tensor arguments, one tensor result.
template <class M, class... Ts>
at::Tensor recompute(M& module, const Ts&... args) {
  static_assert((std::is_same_v<Ts, at::Tensor> && ...), "fsdp::recompute takes tensor arguments");
  M held = module;  // a ModuleHolder or shared_ptr: shares the module
  return detail::recompute_impl(
      [held](const std::vector<at::Tensor>& in) mutable {
        return detail::call_with(held, in, std::index_sequence_for<Ts...>{});
      },
      {args...});
}

}  // namespace fsdp
