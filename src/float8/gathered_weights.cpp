#include "float8/gathered_weights.h"

#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace fsdp {
namespace {

// The marked weights, by tensor object. The weak reference tells a live weight from a new tensor
// that happens to reuse a dead one's address.
struct MarkedWeight {
  c10::weak_intrusive_ptr<c10::TensorImpl> weight;
  std::optional<Float8Operand> gathered;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, MarkedWeight> weights;

  // The live entry of `weight`; null if it is not marked. Call with the mutex held.
  MarkedWeight* find(const at::Tensor& weight) {
    const auto it = weights.find(weight.unsafeGetTensorImpl());
    if (it == weights.end()) return nullptr;
    if (it->second.weight.expired()) {
      weights.erase(it);
      return nullptr;
    }
    return &it->second;
  }
};

Registry& registry() {
  static Registry instance;
  return instance;
}

}  // namespace

void enable_float8_all_gather(const at::Tensor& weight) {
  if (!weight.defined() || weight.dim() != 2 || !at::isFloatingType(weight.scalar_type()))
    throw std::invalid_argument("enable_float8_all_gather: expected a 2-D floating weight [out, in]");
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.weights.begin(); it != r.weights.end();)  // forget dead weights
    it = it->second.weight.expired() ? r.weights.erase(it) : std::next(it);
  r.weights.insert_or_assign(weight.unsafeGetTensorImpl(),
                             MarkedWeight{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), {}});
}

bool float8_all_gather_enabled(const at::Tensor& weight) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  return r.find(weight) != nullptr;
}

namespace float8 {

void set_gathered(const at::Tensor& weight, const Float8Operand& gathered) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  MarkedWeight* marked = r.find(weight);
  TORCH_INTERNAL_ASSERT(marked, "fsdp: a float8-gathered weight is not marked");
  marked->gathered = gathered;
}

void clear_gathered(const at::Tensor& weight) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  if (MarkedWeight* marked = r.find(weight)) marked->gathered.reset();
}

std::optional<Float8Operand> gathered(const at::Tensor& weight) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const MarkedWeight* marked = r.find(weight);
  return marked ? marked->gathered : std::nullopt;
}

}  // namespace float8
}  // namespace fsdp
