#include "fsdp/communicator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/core/ScalarType.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "comm/collective_names.h"

namespace fsdp {

Communicator::Communicator(int rank, int world_size, std::string name,
                           std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), name_(std::move(name)), timeout_(timeout) {
  const char* check = std::getenv("FSDP_CHECK_COLLECTIVES");
  check_collectives_ = check && std::string(check) == "1";
}

// Messages are built from strings, not iostreams: in the Python extension on the GPU machines'
// image, formatting an integer into an ostream crashed inside libstdc++'s locale code.
std::string Communicator::describe() const {
  return "rank " + std::to_string(rank_) + " of communicator '" + name_ + "' (" + std::to_string(world_size_) +
         " ranks, " + backend() + ")";
}

std::string Communicator::bytes_of(const at::Tensor& t) { return std::to_string(t.nbytes()) + " bytes"; }

// A coalesced collective has a piece per parameter of each group: their count and total size.
std::string Communicator::describe_batch(const std::string& op, const std::vector<Buffers>& ops,
                                         const std::string& tag) {
  int64_t bytes = 0;
  for (const Buffers& b : ops) bytes += static_cast<int64_t>(b.input.nbytes());
  std::string what = op + " of " + std::to_string(bytes) + " bytes";
  if (ops.size() > 1) what += " in " + std::to_string(ops.size()) + " pieces";
  return tag.empty() ? what : what + " (" + tag + ")";
}

std::string Communicator::mismatch_hint() {
  return " (ranks whose forwards differ, a sharded module run on some ranks only, name different modules in their "
         "errors; FSDP_CHECK_COLLECTIVES=1 names the first collective that differs)";
}

std::string Communicator::timeout_message(const std::string& what) const {
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.1f", timeout_.count() / 1000.0);
  return "fsdp: " + what + " on " + describe() + " did not complete within " + seconds +
         " s: another rank has exited, is stuck, or called a different collective" + mismatch_hint() +
         ". Raise the limit with FSDP_TIMEOUT_S (fsdp-train --timeout) if ranks are just slow.";
}

void Communicator::check_tensor(const at::Tensor& t, const char* op, const char* role) const {
  auto fail = [&](const std::string& why) {
    throw CollectiveError("fsdp: " + std::string(op) + " on " + describe() + ": " + role + " " +
                          why);
  };
  if (!t.defined()) fail("tensor is undefined");
  if (t.device().type() != device().type()) {
    std::string want = c10::DeviceTypeName(device().type(), /*lower_case=*/true);
    std::string got = c10::DeviceTypeName(t.device().type(), /*lower_case=*/true);
    fail("is a " + got + " tensor, but the " + backend() + " backend moves " + want +
         " tensors: " +
         (device().is_cpu()
              ? "run CUDA models with the NCCL backend (fsdp::init with Device::CUDA)"
              : "move the tensor to this rank's GPU first"));
  }
  if (!t.is_contiguous()) fail("must be contiguous (call .contiguous())");
}

std::vector<Communicator::Buffers> Communicator::checked(const char* op,
                                                        const std::vector<at::Tensor>& outputs,
                                                        const std::vector<at::Tensor>& inputs,
                                                        bool output_gathered) const {
  TORCH_CHECK(outputs.size() == inputs.size(), "fsdp: ", op, " needs one output per input");
  std::vector<Buffers> ops;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(outputs[i], op, "output");
    check_tensor(inputs[i], op, "input");
    const at::Tensor& gathered = output_gathered ? outputs[i] : inputs[i];
    const at::Tensor& chunk = output_gathered ? inputs[i] : outputs[i];
    if (gathered.numel() != chunk.numel() * world_size_ ||
        outputs[i].scalar_type() != inputs[i].scalar_type())
      throw CollectiveError("fsdp: " + std::string(op) + " on " + describe() + ": the " +
                            (output_gathered ? "output" : "input") +
                            " must have world_size x the other's elements and the same dtype; got " +
                            std::to_string(gathered.numel()) + " vs " + std::to_string(chunk.numel()));
    ops.push_back({outputs[i], inputs[i]});
  }
  return ops;
}

namespace {

std::string signature(const std::string& op, const std::vector<at::Tensor>& tensors,
                      const std::string& tag) {
  std::ostringstream s;
  s << op << " of";
  for (const auto& t : tensors) s << " " << t.numel() << " x " << c10::toString(t.scalar_type());
  if (!tag.empty()) s << " (" << tag << ")";
  return s.str();
}

}  // namespace

// The ranks exchange a hash of the collective each is about to issue (one
// all-gather, which pairs up across ranks whatever comes next); every rank
// sees the same mismatch and throws, so none is left waiting.
template <class Describe>
void Communicator::check_same_on_all_ranks(Describe&& signature_of) {
  if (!check_collectives_ || world_size_ == 1) return;
  const std::string what = signature_of();
  const uint64_t n = ++collectives_issued_;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device());
  const auto hash = static_cast<int64_t>(std::hash<std::string>{}(what));
  at::Tensor all = at::empty({world_size_}, opts);
  do_all_gather({{all, at::full({1}, hash, opts)}}, "the cross-rank check");
  const at::Tensor hashes = all.cpu();
  const int64_t* of_rank = hashes.data_ptr<int64_t>();
  std::string differing;
  for (int r = 0; r < world_size_; ++r)
    if (of_rank[r] != hash) differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  if (!differing.empty())
    throw CollectiveError("fsdp: collective #" + std::to_string(n) + " on " + describe() +
                          " differs across ranks: this rank issues " + what + ", rank(s) " +
                          differing + " something else. Every rank must issue the same "
                          "collectives in the same order (FSDP_CHECK_COLLECTIVES=1 found this).");
}

// A communicator of one rank needs no backend: every collective is a local copy or
// nothing. (NCCL 2.28's one-rank reduce-scatter also left the last element of
// an odd-sized output unwritten on H200.)
void Communicator::all_gather_coalesced(const std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& inputs, const std::string& tag) {
  auto ops = checked("all_gather", outputs, inputs, /*output_gathered=*/true);
  check_same_on_all_ranks([&] { return signature("all_gather", inputs, tag); });
  if (world_size_ == 1) {
    for (auto& op : ops)
      if (!op.output.is_same(op.input)) op.output.copy_(op.input);  // the same tensor: gathered in place
    return;
  }
  do_all_gather(ops, tag);
}

void Communicator::all_gather(const at::Tensor& output, const at::Tensor& input) {
  all_gather_coalesced({output}, {input});
}

void Communicator::reduce_scatter_coalesced(const std::vector<at::Tensor>& outputs,
                                            const std::vector<at::Tensor>& inputs, ReduceOp op,
                                            const std::string& tag) {
  auto ops = checked("reduce_scatter", outputs, inputs, /*output_gathered=*/false);
  check_same_on_all_ranks(
      [&] { return signature(reducing("reduce_scatter", op), outputs, tag); });
  if (world_size_ == 1) {
    for (auto& s : ops)  // sum and average of one are the input (the same memory: reduced in place)
      if (s.output.data_ptr() != s.input.data_ptr()) s.output.copy_(s.input);
    return;
  }
  do_reduce_scatter(ops, op, tag);
}

void Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  reduce_scatter_coalesced({output}, {input}, op);
}

void Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_tensor(tensor, "all_reduce", "tensor");
  check_same_on_all_ranks([&] { return signature(reducing("all_reduce", op), {tensor}, ""); });
  if (world_size_ > 1) do_all_reduce(tensor, op);
}

void Communicator::broadcast(const at::Tensor& tensor, int root) {
  check_tensor(tensor, "broadcast", "tensor");
  if (root < 0 || root >= world_size_)
    throw CollectiveError("fsdp: broadcast on " + describe() + ": root " + std::to_string(root) +
                          " is not a rank of the communicator");
  check_same_on_all_ranks([&] { return signature("broadcast from rank " + std::to_string(root), {tensor}, ""); });
  if (world_size_ > 1) do_broadcast(tensor, root);
}

void Communicator::barrier() {
  check_same_on_all_ranks([] { return std::string("barrier"); });
  if (world_size_ > 1) do_barrier();
}

int Communicator::count_ranks(bool condition) {
  at::Tensor count = at::full({1}, condition ? 1L : 0L, at::TensorOptions(at::kLong).device(device()));
  all_reduce(count, ReduceOp::Sum);
  return static_cast<int>(count.item<int64_t>());
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  if (color < 0)
    throw std::invalid_argument("fsdp: split of " + describe() + " into '" + name + "': color " +
                                std::to_string(color) + " is negative; every rank must join a part");
  barrier();  // timed: every peer is there before the backend's untimed split
  return do_split(color, key, name);
}

}  // namespace fsdp
