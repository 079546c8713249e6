#include "runtime/group_state.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "fsdp/fully_shard.h"
#include "runtime/root_state.h"
#include "runtime/runtime.h"
#include "shard/trace.h"

namespace fsdp {
namespace {

// FSDP_EVENT_LOG=1 prints every runtime event to stderr (for debugging hooks). Its old name,
// FSDP_TRACE, is still read, with a line saying the new one: "trace" is the Chrome trace.
bool logging_events() {
  static const bool on = [] {
    const char* old_name = std::getenv("FSDP_TRACE");
    const char* v = std::getenv("FSDP_EVENT_LOG");
    if (!v && old_name) {
      std::fprintf(stderr, "fsdp: FSDP_TRACE is now called FSDP_EVENT_LOG (the event log); reading it\n");
      v = old_name;
    }
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

// Runs after AccumulateGrad stored a parameter's gradient.
class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(std::weak_ptr<GroupState> state, size_t index)
      : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto state = state_.lock()) state->on_gradient(index_);
    return outputs;
  }

 private:
  std::weak_ptr<GroupState> state_;
  size_t index_;
};

}  // namespace

GroupState::GroupState(std::string module_name,
                       std::vector<std::pair<std::string, at::Tensor>> params,
                       std::vector<std::shared_ptr<GroupState>> inner, const ShardOptions& options)
    : module_name_(std::move(module_name)),
      params_(std::move(params), options),
      inner_(inner.begin(), inner.end()),
      reshard_after_forward_(options.reshard_after_forward) {
  for (const auto& p : params_.sharded()) {
    if (p.param.requires_grad())
      ++trainable_params_;
    else
      has_frozen_params_ = true;
  }
  accumulators_.resize(params_.sharded().size());
}

std::vector<std::shared_ptr<GroupState>> GroupState::groups_under() {
  std::vector<std::shared_ptr<GroupState>> under{shared_from_this()};
  for (const auto& weak : inner_)
    if (auto state = weak.lock()) under.push_back(std::move(state));
  return under;
}

void GroupState::start_step(uint64_t step, bool is_root) {
  if (step_ != step) {
    step_ = step;
    is_root_ = false;
    backward_started_ = false;
    reduced_ = false;
    gradients_ready_ = 0;
  }
  is_root_ = is_root_ || is_root;
}

void GroupState::pre_forward() {
  const Runtime& runtime = Runtime::get();
  RootState& root = this->root();
  root.enter_forward(*this);
  log_event("pre_forward", runtime.recomputing() ? "(recompute)" : is_root_ ? "(root)" : "");
  try {
    if (runtime.recomputing()) {
      start_backward(/*recompute=*/true);  // a recompute is where this group's backward begins
      params_.wait_for_unshard();
    } else {
      unshard();
      for (GroupState* next : root.forward_prefetch_targets(*this)) next->prefetch();
      params_.wait_for_unshard();
      compute_span_ =
          Trace::get().begin("forward " + params_.label(), Trace::Track::Compute, compute_stream());
    }
  } catch (...) {
    root.exit_forward();
    throw;
  }
}

void GroupState::unshard() {
  if (!params_.is_unsharded()) root().all_gather(*this);
}

void GroupState::prefetch() {
  if (params_.is_unsharded()) return;
  log_event("prefetch", "");
  unshard();
  Runtime::get().count_prefetch();
}

void GroupState::reshard() {
  auto last_use = params_.reshard();
  if (root_) root_->after_reshard(std::move(last_use));
  Trace::get().mark();  // the parameters' memory is back (cost model)
}

void GroupState::abort_forward() { root().exit_forward(); }

RootState& GroupState::root() { return root_ ? *root_ : Runtime::get().root_of(*this); }

std::optional<c10::Stream> GroupState::compute_stream() const {
  const auto& streams = DeviceStreams::of(params_.device());
  if (!streams.active()) return std::nullopt;
  return streams.compute();
}

void GroupState::post_forward(const std::vector<at::Tensor>& outputs) {
  Trace::get().end(compute_span_, compute_stream());
  // A recompute is traced apart from the backward that follows it (the cost model tells them apart).
  if (Runtime::get().recomputing())
    compute_span_ = Trace::get().begin("backward " + params_.label(), Trace::Track::Compute, compute_stream());
  root().exit_forward();
  bool needs_backward = false;
  if (c10::GradMode::is_enabled()) {
    // Under a recomputed forward with autograd on (Python's non-reentrant checkpoint) the
    // recompute, not the outputs' gradients, starts this group's backward; the graph built here
    // is still the one backward runs, so its gradient accumulators are hooked all the same.
    const bool started_by_outputs = !Runtime::get().in_recomputed_forward();
    std::weak_ptr<GroupState> self = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      needs_backward = true;
      if (!started_by_outputs) continue;
      t.register_hook([self](const at::Tensor&) {
        if (auto state = self.lock()) state->pre_backward();
      });
    }
  }
  if (needs_backward) hook_gradient_accumulators();
  // The root's backward starts right after forward, and a recompute's right after it: keep their
  // parameters; so does a group not resharded after forward, recomputed or not.
  const bool backward_follows = needs_backward || Runtime::get().in_recomputed_forward();
  const bool keep = backward_follows && (is_root_ || !reshard_after_forward_ || Runtime::get().recomputing());
  if (!keep) reshard();
}

// The accumulator is a parameter's leaf node in the graph. set_data to a new
// dtype (mixed precision) makes autograd create a fresh one, so each forward
// checks that the one this graph uses carries our hook.
void GroupState::hook_gradient_accumulators() {
  const auto& params = params_.sharded();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].param.requires_grad()) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(params[i].param);
    if (!accumulator || accumulator == accumulators_[i]) continue;
    accumulator->add_post_hook(std::make_unique<GradientReadyHook>(weak_from_this(), i));
    accumulators_[i] = std::move(accumulator);
  }
}

void GroupState::log_event(const char* event, const char* detail) const {
  if (!logging_events()) return;
  std::fprintf(stderr, "fsdp event: rank %d step %llu group %d (%s) %s %s (thread %zx)\n",
               params_.comm().rank(), static_cast<unsigned long long>(step_), id_,
               module_name_.c_str(), event, detail,
               std::hash<std::thread::id>{}(std::this_thread::get_id()));
}

void GroupState::pre_backward() {
  log_event("pre_backward", backward_started_ ? "(again)" : "");
  start_backward(/*recompute=*/false);
}

void GroupState::start_backward(bool recompute) {
  if (backward_started_) return;
  backward_started_ = true;
  root().enter_backward(*this);
  unshard();
  for (GroupState* next : root().backward_prefetch_targets(*this)) next->prefetch();
  params_.wait_for_unshard();
  const char* phase = recompute ? "recompute " : "backward ";
  compute_span_ = Trace::get().begin(phase + params_.label(), Trace::Track::Compute, compute_stream());
}

// AccumulateGrad runs once per parameter per backward, after every use of the
// parameter in the graph: once all trainable parameters have their
// gradients, none of the group's backward work that needs them remains.
void GroupState::on_gradient(size_t index) {
  log_event("gradient", params_.sharded()[index].name.c_str());
  if (!backward_started_ || reduced_) return;
  if (++gradients_ready_ == trainable_params_) post_backward();
}

void GroupState::post_backward() {
  if (logging_events()) {
    std::string missing;
    for (const auto& p : params_.sharded())
      if (p.param.requires_grad() && !p.param.grad().defined()) missing += " " + p.name;
    log_event("post_backward", missing.empty() ? "" : ("without gradient:" + missing).c_str());
  }
  Trace::get().end(compute_span_, compute_stream());
  // Frozen parameters get no AccumulateGrad, so nothing tells us when their
  // last use in backward has run: they stay unsharded until the end.
  hand_off_gradients(/*reshard_first=*/!has_frozen_params_);
  if (has_frozen_params_) return;
  if (step_in_backward_ && gradient_sync_) {
    // Its reduce-scatter now (not in a bucket), then its step (RootState::step_in_backward).
    root().flush_reduce_scatters();
    root().step_in_backward(*this);
  }
}

void GroupState::step_committed_gradients() {
  if (!step_in_backward_ || !step_owed_) return;
  step_owed_ = false;
  std::vector<at::Tensor> stepped;
  for (const auto& p : params_.sharded())
    if (p.param.grad().defined()) stepped.push_back(p.param);
  if (stepped.empty()) return;
  const int span = Trace::get().begin("step " + params_.label(), Trace::Track::HostStep);
  try {
    step_in_backward_(stepped);
  } catch (const std::exception& e) {
    throw std::runtime_error("fsdp: the optimizer step in backward of '" + params_.label() + "' failed: " + e.what());
  }
  Trace::get().end(span);
  if (step_frees_gradients_)
    for (at::Tensor& param : stepped) param.mutable_grad() = at::Tensor();
}

// The copy into the reduce-scatter input (or into the unsynced sums) is compute-stream work that
// the cost model times apart from the backward (GroupCost::handoff_ms).
void GroupState::hand_off_gradients(bool reshard_first) {
  std::vector<at::Tensor> grads = params_.take_gradients();
  if (reshard_first) reshard();
  const int span = Trace::get().begin("hand-off " + params_.label(), Trace::Track::Compute, compute_stream());
  if (gradient_sync_)
    params_.prepare_reduce_scatter(std::move(grads));
  else
    params_.hold_unsynced_gradients(std::move(grads));
  Trace::get().end(span, compute_stream());
  if (gradient_sync_) root().reduce_scatter(params_);
  reduced_ = true;
  step_owed_ = gradient_sync_ && step_in_backward_;  // the end-of-backward callback pays it, if not before
}

void GroupState::finish_backward() {
  log_event("finish_backward", backward_started_ && !reduced_ ? "(reduce-scatter outstanding)" : "");
  if (backward_started_ && !reduced_) hand_off_gradients(/*reshard_first=*/true);
  reshard();
  backward_started_ = false;
  reduced_ = false;
  gradients_ready_ = 0;
}

namespace detail {

ForwardScope::ForwardScope(GroupState& state) : state_(state) { state_.pre_forward(); }

ForwardScope::~ForwardScope() {
  if (!finished_) state_.abort_forward();
}

void ForwardScope::finish(const std::vector<at::Tensor>& outputs) {
  finished_ = true;
  state_.post_forward(outputs);
}

}  // namespace detail
}  // namespace fsdp
