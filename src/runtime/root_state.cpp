#include "runtime/root_state.h"

#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

#include "runtime/group_state.h"
#include "runtime/runtime.h"
#include "shard/group_params.h"
#include "shard/trace.h"

namespace fsdp {

RootState::RootState(std::weak_ptr<GroupState> top, RuntimeStats& stats)
    : top_group_(std::move(top)), top_name_(top_group_.lock()->module_name()), stats_(stats) {}

RuntimeOptions RootState::options() const {
  const auto top = top_group_.lock();
  if (top && top->runtime_options()) return *top->runtime_options();
  return Runtime::get().options();
}

void RootState::add_member(const std::shared_ptr<GroupState>& state) { members_.push_back(state); }

void RootState::adopt(RootState& other) {
  for (const auto& state : other.members()) {
    state->root_ = shared_from_this();
    members_.push_back(state);
  }
  other.members_.clear();
}

std::vector<std::shared_ptr<GroupState>> RootState::members() const {
  std::vector<std::shared_ptr<GroupState>> out;
  for (const auto& weak : members_)
    if (auto state = weak.lock()) out.push_back(std::move(state));
  return out;
}

void RootState::enter_forward(GroupState& state) {
  Runtime& runtime = Runtime::get();
  if (runtime.recomputing()) {
    ++depth_;
    return;
  }
  const bool is_root = depth_ == 0;
  if (is_root) {
    host_steps_.wait_all();
    // Step numbers are unique across roots, so a group moved between roots never mistakes
    // another root's step for its own.
    step_ = runtime.new_step();
    refresh_gather_transforms();
    forward_order_.clear();
    callback_queued_ = false;
    forward_pass_.begin_pass();
  }
  if (state.step_ != step_) {
    forward_order_.push_back(state.weak_from_this());
    if (!forward_pass_.observe(state.id_)) ++stats_.order_departures;
  }
  state.start_step(step_, is_root);
  ++depth_;
}

// The gather transforms' state (float8: the scales) comes from the weights as the optimizer left
// them: one small collective for all of this root's transformed weights, before its first
// all-gather. In the groups' creation order, the same on every rank (members_ may differ in order
// between ranks).
void RootState::refresh_gather_transforms() {
  auto states = members();
  std::sort(states.begin(), states.end(), [](const auto& a, const auto& b) { return a->id_ < b->id_; });
  std::vector<GroupParams*> groups;
  for (const auto& state : states) groups.push_back(&state->params());
  GroupParams::refresh_gather_transforms(groups);
}

void RootState::exit_forward() {
  if (--depth_ > 0 || Runtime::get().recomputing()) return;
  forward_pass_.end_pass();
  reshard_strays(/*only_idle_this_step=*/true);
}

void RootState::enter_backward(GroupState& state) {
  if (!callback_queued_) {
    callback_queued_ = true;
    backward_pass_.begin_pass();
    std::shared_ptr<RootState> self = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([self] { self->end_of_backward(); });
  }
  if (!backward_pass_.observe(state.id_)) ++stats_.order_departures;
}

// A prefetched group that did not run (the order changed) holds memory for
// nothing: give it back. Forward end: groups that did not run this step;
// backward end: every group still unsharded.
void RootState::reshard_strays(bool only_idle_this_step) {
  for (const auto& state : members())
    if (state->params().is_unsharded() && (!only_idle_this_step || state->step_ != step_)) state->reshard();
}

// In forward: the group's forward already ran this step. In backward: its
// backward already started, or it did not run forward this step (so it has
// no backward to run).
bool RootState::ran_in_pass(const GroupState& state, bool backward) const {
  return backward ? state.backward_started_ || state.step_ != step_ : state.step_ == step_;
}

std::vector<GroupState*> RootState::prefetch_targets(const ExecutionOrder& order, const GroupState& state,
                                                     bool backward) {
  std::vector<GroupState*> targets;
  const int depth = state.prefetch_depth() >= 0 ? state.prefetch_depth() : options().prefetch_depth;
  const auto ids = order.next(state.id_, depth);
  if (ids.empty()) return targets;
  const auto states = members();
  // In execution order, never the registry's (ordered by address, which
  // differs between processes): every rank must issue the same all-gathers
  // in the same order, or equal-sized ones silently trade data.
  for (int id : ids) {
    GroupState* candidate = find_state(states, id);
    // Guards against a stale order: never prefetch a group that already ran
    // in this pass (it would be gathered again for nothing).
    if (candidate && !ran_in_pass(*candidate, backward)) targets.push_back(candidate);
  }
  return targets;
}

GroupState* RootState::find_state(const std::vector<std::shared_ptr<GroupState>>& states, int id) {
  auto it = std::find_if(states.begin(), states.end(), [id](const auto& s) { return s->id_ == id; });
  return it == states.end() ? nullptr : it->get();
}

std::vector<GroupState*> RootState::forward_prefetch_targets(const GroupState& state) {
  return prefetch_targets(forward_pass_, state, /*backward=*/false);
}

std::vector<GroupState*> RootState::backward_prefetch_targets(const GroupState& state) {
  return prefetch_targets(backward_pass_, state, /*backward=*/true);
}

void RootState::all_gather(GroupState& state) {
  const RuntimeOptions options = this->options();
  std::vector<GroupParams*> groups{&state.params()};
  const size_t limit = options.bucket_bytes();
  size_t bytes = state.params().unsharded_size_bytes();
  if (limit > 0 && bytes < limit) {
    // The small groups expected next that have not run, past any large ones (whose own
    // all-gathers are not delayed), until the bucket is full.
    const bool backward = callback_queued_ || Runtime::get().recomputing();
    const auto& order = backward ? backward_pass_ : forward_pass_;
    std::vector<std::shared_ptr<GroupState>> states = members();
    for (int id : order.next(state.id_, static_cast<int>(states.size()))) {
      GroupState* found = find_state(states, id);
      if (!found) continue;
      GroupState& next = *found;
      const size_t next_bytes = next.params().unsharded_size_bytes();
      if (next_bytes >= limit || ran_in_pass(next, backward) || next.params().is_unsharded() ||
          &next.params().comm() != &state.params().comm())
        continue;
      if (bytes + next_bytes > limit) break;
      groups.push_back(&next.params());
      bytes += next_bytes;
    }
  }
  // The all-gather cap: past it the CPU waits for the oldest gathered memory's last use (each wait
  // a span of the host track).
  allgathers_.set_limit(options.max_inflight_allgathers);
  allgathers_.drop_finished();
  const int span = allgathers_.full() ? Trace::get().begin("wait: all-gather cap, for " + state.params().label(),
                                                           Trace::Track::HostWait)
                                      : -1;
  stats_.allgather_waits += allgathers_.make_room();
  Trace::get().end(span);
  Trace::get().mark();  // what the compute before it left allocated (cost model)
  GroupParams::unshard_together(groups);
  ++stats_.all_gathers;
}

void RootState::after_reshard(std::shared_ptr<c10::Event> last_use) {
  if (last_use) allgathers_.push(DeviceWork{std::move(last_use), {}});
}

// The bucket goes out once it holds bucket_mb (at once when bucketing is off; a large group takes
// the small ones waiting with it), or once reduce_bucket_max_wait later groups joined it.
void RootState::reduce_scatter(GroupParams& group) {
  const RuntimeOptions options = this->options();
  const bool waiting = !reduce_bucket_.empty();
  reduce_bucket_.push_back(&group);
  reduce_bucket_bytes_ += group.unsharded_size_bytes();
  const bool waited_enough = waiting && options.reduce_bucket_max_wait > 0 &&
                             ++reduce_bucket_waited_ >= options.reduce_bucket_max_wait;
  if (reduce_bucket_bytes_ >= options.bucket_bytes() || waited_enough) flush_reduce_scatters();
}

// Past the cap the compute stream, not the CPU, waits for the oldest reduce-scatter: its input
// then goes back to the compute stream's pool behind the collective that read it (the rule of
// shard/streams.h), so memory is bounded as a CPU wait would bound it, and the CPU goes on issuing
// the rest of backward and what follows it. (Held here, the CPU met the end of backward with the
// GPU nearly done, and a Python script's clip and optimizer step over DTensors, milliseconds of
// host time, ran with the GPU idle.)
void RootState::flush_reduce_scatters() {
  if (reduce_bucket_.empty()) return;
  const DeviceStreams& streams = DeviceStreams::of(reduce_bucket_.front()->device());
  reduce_scatters_.set_limit(options().max_inflight_reduce_scatters);
  stats_.reduce_scatter_waits += reduce_scatters_.make_room([&](const DeviceWork& work) {
    if (work.event) streams.wait(streams.compute(), *work.event);
  });
  reduce_scatters_.push(GroupParams::reduce_scatter_together(reduce_bucket_));
  ++stats_.reduce_scatters;
  reduce_bucket_.clear();
  reduce_bucket_bytes_ = 0;
  reduce_bucket_waited_ = 0;
}

void RootState::step_in_backward(GroupState& state) {
  const int limit = options().max_pending_host_steps;
  // A front end's hooks (gradients kept: frees_gradients false) run on the thread that runs
  // backward; an optimizer's step of offloaded shards on a host thread beside it.
  if (state.params().offloaded() && limit > 0 && state.frees_gradients_in_backward()) {
    const bool waited = host_steps_.submit(
        [keep = state.shared_from_this()] {
          // The group's device on this thread too: a CUDA call here must not open a context on GPU 0.
          const c10::DeviceGuard on_device(keep->params().device());
          GroupParams::commit_gradients({&keep->params()});  // waits for the gradients' copy to the host
          keep->step_committed_gradients();
        },
        limit);
    if (waited) ++stats_.host_step_waits;
    return;
  }
  host_steps_.wait_all();
  GroupParams::commit_gradients({&state.params()});
  state.step_committed_gradients();
}

// Groups finish in reverse forward order, the order their backward ran in,
// so all ranks issue any outstanding reduce-scatters in the same order. Then
// the compute stream waits for each reduce-scatter and takes its result as
// the sharded gradients; after that every reduce-scatter input can go.
void RootState::end_of_backward() {
  callback_queued_ = false;
  host_steps_.wait_all();
  std::vector<std::shared_ptr<GroupState>> groups;
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
    if (auto state = it->lock()) groups.push_back(std::move(state));
  for (auto& state : groups) state->finish_backward();
  flush_reduce_scatters();
  std::vector<GroupParams*> committed;
  for (auto& state : groups) committed.push_back(&state->params());
  GroupParams::commit_gradients(committed);
  for (auto& state : groups) state->step_committed_gradients();  // those not stepped in backward yet
  reduce_scatters_.clear();
  backward_pass_.end_pass();
  reshard_strays(/*only_idle_this_step=*/false);
}

}  // namespace fsdp
