// The tensor-parallel collectives as autograd functions (fsdp/tensor_parallel.h). Each forward and
// backward issues one collective on the tp communicator, on the caller's stream; autograd runs a
// backward's collectives in the reverse order of the forward's on every rank alike.
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>
#include <string>

#include "fsdp/tensor_parallel.h"

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The communicator travels through the context as its address: the mesh that made it outlives
// every backward of the model that uses it.
void keep(AutogradContext* ctx, Communicator& tp) { ctx->saved_data["tp"] = reinterpret_cast<int64_t>(&tp); }
Communicator& kept(AutogradContext* ctx) { return *reinterpret_cast<Communicator*>(ctx->saved_data["tp"].toInt()); }

at::Tensor all_gather_rows(const at::Tensor& x, Communicator& tp) {
  const at::Tensor input = x.contiguous();
  auto shape = input.sizes().vec();
  shape[0] *= tp.world_size();
  at::Tensor out = at::empty(shape, input.options());
  tp.all_gather(out, input);
  return out;
}

at::Tensor reduce_scatter_rows(const at::Tensor& x, Communicator& tp) {
  if (x.dim() == 0 || x.size(0) % tp.world_size() != 0)
    throw std::invalid_argument("fsdp::tp: " + std::to_string(x.dim() ? x.size(0) : 0) + " rows do not split over " +
                                std::to_string(tp.world_size()) + " tp ranks (" + tp.describe() +
                                "): make the tokens of a step (batch x sequence) a multiple of the tp degree");
  const at::Tensor input = x.contiguous();
  auto shape = input.sizes().vec();
  shape[0] /= tp.world_size();
  at::Tensor out = at::empty(shape, input.options());
  tp.reduce_scatter(out, input, ReduceOp::Sum);
  return out;
}

struct CopyIn : torch::autograd::Function<CopyIn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* tp) {
    keep(ctx, *tp);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0].contiguous().clone();
    kept(ctx).all_reduce(grad, ReduceOp::Sum);
    return {grad, at::Tensor()};
  }
};

struct GatherRows : torch::autograd::Function<GatherRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* tp) {
    keep(ctx, *tp);
    return all_gather_rows(x, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scatter_rows(grads[0], kept(ctx)), at::Tensor()};
  }
};

struct ScatterRows : torch::autograd::Function<ScatterRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* tp) {
    keep(ctx, *tp);
    return reduce_scatter_rows(x, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_rows(grads[0], kept(ctx)), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_in(const at::Tensor& x, Communicator& tp) { return CopyIn::apply(x, &tp); }
at::Tensor gather_rows(const at::Tensor& x, Communicator& tp) { return GatherRows::apply(x, &tp); }
at::Tensor scatter_rows(const at::Tensor& x, Communicator& tp) { return ScatterRows::apply(x, &tp); }

}  // namespace fsdp::tp
