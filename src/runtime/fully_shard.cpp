#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <torch/nn/module.h>

#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "fsdp/fully_shard.h"
#include "fsdp/launch.h"
#include "runtime/module_state.h"
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
NamedParams collect_params(torch::nn::Module& module, const std::string& module_name,
                           const Communicator& comm) {
  // Where inner sharded modules sit, so that their parameters can be told
  // apart from the same tensors reached through another path (tied weights).
  std::unordered_map<const ModuleState*, std::vector<std::string>> inner_prefixes;
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    if (ModuleState* inner = Runtime::get().state_of(*item.value()))
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
                owner->state->group().params()[owner->index].name +
                "'. Apply fully_shard bottom-up (inner modules first, the root last), and shard "
                "modules that share a weight (e.g. a tied embedding and output head) in one "
                "fully_shard call that contains both.");
      continue;
    }
    if (!seen.emplace(t.unsafeGetTensorImpl(), name).second) continue;
    if (t.device().type() != comm.device().type() ||
        (comm.device().has_index() && t.device() != comm.device()))
      throw shard_error(module_name, "parameter '" + name + "' is on " + t.device().str() +
                                         " but the communicator (" + comm.backend() +
                                         ") works on " + comm.device().str() +
                                         ": move the model there before sharding");
    params.emplace_back(name, t);
  }
  return params;
}

uint64_t structure_hash(const NamedParams& params) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](const void* data, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(data)[i]) * 1099511628211ull;
  };
  for (const auto& [name, t] : params) {
    mix(name.data(), name.size());
    int64_t dtype = static_cast<int64_t>(t.scalar_type());
    mix(&dtype, sizeof(dtype));
    for (int64_t d : t.sizes()) mix(&d, sizeof(d));
  }
  return h;
}

std::invalid_argument structure_error(const std::string& module_name, int64_t first_hash, int64_t other_hash,
                                      int other_rank, const Communicator& comm, size_t params) {
  std::ostringstream s;
  s << "the model differs across ranks: the parameters (names, shapes, dtypes) hash to " << std::hex << first_hash
    << " on rank 0 but " << other_hash << " on rank " << std::dec << other_rank << " of '" << comm.group_name()
    << "' (this is rank " << comm.rank() << ", " << params << " parameters here). Build the same model on every "
    << "rank before sharding.";
  return shard_error(module_name, s.str());
}

// Every rank must shard the same parameters in the same order, or the
// collectives would exchange mismatched buffers.
void check_same_structure(Communicator& comm, const NamedParams& params,
                          const std::string& module_name) {
  const auto opts = at::TensorOptions().dtype(at::kLong).device(comm.device());
  at::Tensor mine = at::full({1}, static_cast<int64_t>(structure_hash(params)), opts);
  at::Tensor all = at::empty({comm.world_size()}, opts);
  comm.all_gather(all, mine);
  all = all.cpu();
  const int64_t* h = all.data_ptr<int64_t>();
  for (int r = 1; r < comm.world_size(); ++r)
    if (h[r] != h[0]) throw structure_error(module_name, h[0], h[r], r, comm, params.size());
}

// HSDP: a replicate group joins the ranks that hold the same shard of equally large shard groups,
// with the same parameters (one all-gather of [shard rank, shard count, structure hash]).
void check_replicas(const Communicator& comm, Communicator& replicate, const NamedParams& params,
                    const std::string& module_name) {
  const std::string fix = ": make both communicators with fsdp::make_mesh";
  if (replicate.device() != comm.device())
    throw shard_error(module_name, "the replicate communicator works on " + replicate.device().str() +
                                       " but the shard communicator on " + comm.device().str() + fix);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(comm.device());
  at::Tensor all = at::empty({3 * replicate.world_size()}, opts);
  const auto hash = static_cast<int64_t>(structure_hash(params));
  replicate.all_gather(all, at::tensor({int64_t(comm.rank()), int64_t(comm.world_size()), hash}, opts));
  all = all.cpu();
  const int64_t* row = all.data_ptr<int64_t>();
  const int64_t first_hash = row[2];
  for (int r = 0; r < replicate.world_size(); ++r, row += 3) {
    if (row[0] != comm.rank() || row[1] != comm.world_size())
      throw shard_error(module_name, "rank " + std::to_string(r) + " of the replicate group '" +
                                         replicate.group_name() + "' holds shard " + std::to_string(row[0]) +
                                         " of " + std::to_string(row[1]) + ", this rank shard " +
                                         std::to_string(comm.rank()) + " of " + std::to_string(comm.world_size()) +
                                         "; a replicate group joins the ranks holding the same shard" + fix);
    if (row[2] != first_hash) throw structure_error(module_name, first_hash, row[2], r, replicate, params.size());
  }
}

}  // namespace

std::shared_ptr<ModuleState> fully_shard(torch::nn::Module& module, const ShardOptions& options) {
  const std::string module_name = module.name();
  std::shared_ptr<const torch::nn::Module> owned;
  try {
    owned = module.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    throw shard_error(module_name, "the module must be owned by a shared_ptr (a ModuleHolder "
                                   "such as torch::nn::Linear, or std::make_shared)");
  }
  if (Runtime::get().state_of(module))
    throw shard_error(module_name, "this module is already sharded: call fully_shard once per module");
  ShardOptions resolved = options;
  if (!resolved.comm) resolved.comm = default_communicator();
  NamedParams params = collect_params(module, module_name, *resolved.comm);
  check_same_structure(*resolved.comm, params, module_name);
  if (resolved.replicate) check_replicas(*resolved.comm, *resolved.replicate, params, module_name);
  auto state = std::make_shared<ModuleState>(module_name, std::move(params), resolved);
  Runtime::get().add(owned, state);
  return state;
}

ModuleState* state_of(const torch::nn::Module& module) { return Runtime::get().state_of(module); }

namespace {

// Applies `set` to the state of every sharded module under `root` (itself included).
template <class Set>
void for_each_state(torch::nn::Module& root, const char* caller, Set&& set) {
  bool any = false;
  for (const auto& module : root.modules(/*include_self=*/true))
    if (ModuleState* state = Runtime::get().state_of(*module)) {
      set(*state);
      any = true;
    }
  if (!any)
    throw std::invalid_argument(std::string("fsdp::") + caller + "(" + root.name() +
                                "): no module in it is sharded; call fully_shard first");
}

}  // namespace

void set_requires_gradient_sync(torch::nn::Module& root, bool sync) {
  for_each_state(root, "set_requires_gradient_sync", [sync](ModuleState& state) { state.set_gradient_sync(sync); });
}

void set_step_in_backward(torch::nn::Module& root, GroupStep step) {
  for_each_state(root, "set_step_in_backward", [&step](ModuleState& state) { state.set_step_in_backward(step); });
}

}  // namespace fsdp
