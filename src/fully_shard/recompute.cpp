#include "fsdp/recompute.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include "fsdp/group.h"
#include "runtime/runtime.h"

namespace fsdp::detail {
namespace {

using torch::autograd::variable_list;

// The output's gradient function: recompute, then back-propagate through the
// recomputed graph (a nested backward), and hand the inputs' gradients on.
class RecomputeBackward : public torch::autograd::Node {
 public:
  RecomputeBackward(std::function<at::Tensor(const std::vector<at::Tensor>&)> run,
                     std::vector<at::Tensor> inputs)
      : run_(std::move(run)), inputs_(std::move(inputs)) {}

  variable_list apply(variable_list&& grads) override {
    std::vector<at::Tensor> detached;
    for (const auto& t : inputs_) {
      at::Tensor d = t.defined() ? t.detach() : t;
      if (t.defined() && t.requires_grad()) d.requires_grad_(true);
      detached.push_back(d);
    }
    at::Tensor output;
    {
      c10::AutoGradMode grad_on(true);  // inside backward: Runtime::recomputing() is true
      output = run_(detached);
    }
    if (output.requires_grad()) torch::autograd::backward({output}, {grads.at(0)});
    variable_list input_grads;
    for (const auto& d : detached) input_grads.push_back(d.defined() ? d.grad() : at::Tensor());
    inputs_.clear();  // a second backward through a checkpoint is not supported
    return input_grads;
  }
  std::string name() const override { return "fsdp::RecomputeBackward"; }

 private:
  std::function<at::Tensor(const std::vector<at::Tensor>&)> run_;
  std::vector<at::Tensor> inputs_;
};

}  // namespace

at::Tensor recompute_impl(std::function<at::Tensor(const std::vector<at::Tensor>&)> run,
                           std::vector<at::Tensor> inputs) {
  if (!c10::GradMode::is_enabled()) return run(inputs);
  at::Tensor output;
  {
    c10::NoGradGuard no_grad;
    RecomputedForwardScope checkpointed;
    output = run(inputs);
  }
  auto node = std::shared_ptr<RecomputeBackward>(new RecomputeBackward(run, inputs),
                                                  torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::create_gradient_edge(output, std::move(node));
  return output;
}

}  // namespace fsdp::detail
