#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <torch/nn/module.h>

#include <stdexcept>
#include <unordered_set>

#include "fsdp/fully_shard.h"
#include "fsdp/launch.h"
#include "fsdp/group.h"
#include "runtime/group_state.h"
#include "runtime/runtime.h"

namespace fsdp {
namespace {

using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;

std::invalid_argument shard_error(const std::string& module, const std::string& why) {
  return std::invalid_argument("fsdp::fully_shard(" + module + "): " + why);
}

bool is_under(const std::string& name, const std::string& prefix) {
  return prefix.empty() || name.rfind(prefix + ".", 0) == 0;
}

// The parameters this call shards: those not managed by an inner
// fully_shard, each tensor once (a weight tied within the module is one
// parameter under two names).
NamedParams collect_params(torch::nn::Module& module, const std::string& module_name) {
  // Where inner sharded modules sit, so that their parameters can be told
  // apart from the same tensors reached through another path (tied weights).
  std::unordered_map<const GroupState*, std::vector<std::string>> inner_prefixes;
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    if (GroupState* inner = group_of_owner(item.value().get()))
      inner_prefixes[inner].push_back(item.key());

  NamedParams params;
  std::unordered_map<const void*, std::string> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    const at::Tensor& t = item.value();
    if (auto owner = Runtime::get().owner_of(t)) {
      const auto& prefixes = inner_prefixes[owner->state.get()];
      bool reached_inside = false;
      for (const auto& prefix : prefixes) reached_inside = reached_inside || is_under(name, prefix);
      if (!reached_inside)
        throw shard_error(
            module_name,
            "parameter '" + name + "' is already managed by fully_shard(" +
                owner->state->module_name() + ") as '" +
                owner->state->params().sharded()[owner->index].name +
                "'. Apply fully_shard bottom-up (inner modules first, the root last), and shard "
                "modules that share a weight (e.g. a tied embedding and output head) in one "
                "fully_shard call that contains both.");
      continue;
    }
    if (!seen.emplace(t.unsafeGetTensorImpl(), name).second) continue;
    params.emplace_back(name, t);
  }
  return params;
}

}  // namespace

std::shared_ptr<GroupState> fully_shard(torch::nn::Module& module, const ShardOptions& options) {
  const std::string module_name = module.name();
  std::shared_ptr<const torch::nn::Module> owned;
  try {
    owned = module.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    throw shard_error(module_name, "the module must be owned by a shared_ptr (a ModuleHolder "
                                   "such as torch::nn::Linear, or std::make_shared)");
  }
  if (group_of_owner(&module))
    throw shard_error(module_name, "this module is already sharded: call fully_shard once per module");
  GroupSpec spec{module_name, collect_params(module, module_name), {}, &module, owned};
  // The groups inside it: those of its submodules at every depth.
  for (const auto& sub : module.modules(/*include_self=*/false))
    if (GroupState* inner = group_of_owner(sub.get())) spec.inner.push_back(inner->shared_from_this());
  return shard_group(std::move(spec), options);
}

GroupState* state_of(const torch::nn::Module& module) { return group_of_owner(&module); }

namespace {

// Applies `set` to the state of every sharded module under `root` (itself included).
template <class Set>
void for_each_state(torch::nn::Module& root, const char* caller, Set&& set) {
  bool any = false;
  for (const auto& module : root.modules(/*include_self=*/true))
    if (GroupState* state = group_of_owner(module.get())) {
      set(*state);
      any = true;
    }
  if (!any)
    throw std::invalid_argument(std::string("fsdp::") + caller + "(" + root.name() +
                                "): no module in it is sharded; call fully_shard first");
}

}  // namespace

void set_requires_gradient_sync(torch::nn::Module& root, bool sync) {
  for_each_state(root, "set_requires_gradient_sync", [sync](GroupState& state) { state.set_gradient_sync(sync); });
}

void set_runtime_options(torch::nn::Module& root, const RuntimeOptions& options) {
  GroupState* state = group_of_owner(&root);
  if (!state)
    throw std::invalid_argument("fsdp::set_runtime_options(" + root.name() +
                                "): the module is not sharded; call fully_shard on it first (the root)");
  set_runtime_options(*state, options);
}

void set_step_in_backward(torch::nn::Module& root, StepInBackward step) {
  for_each_state(root, "set_step_in_backward", [&step](GroupState& state) { state.set_step_in_backward(step, /*frees_gradients=*/true); });
}

}  // namespace fsdp
