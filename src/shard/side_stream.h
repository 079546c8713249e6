// What the all-gather and reduce-scatter paths (all_gather.cpp, reduce_scatter.cpp) share: issuing
// a collective on its side stream (a span of fsdp.cpp's trace and a torch.profiler range), and the
// name a bucket of groups has in traces.
#pragma once

#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shard/group_params.h"
#include "shard/streams.h"
#include "shard/trace.h"

namespace fsdp {

// Runs `issue` on the side stream of `track` (on GPUs): the side stream first
// waits for the compute stream's position (the first stream rule in
// src/shard/README.md), and the work is one trace span. Returns the side stream's
// event after it; null on CPU, where everything completed in the call.
// `after`: an event of another side stream the work must also follow.
template <class Issue>
inline std::shared_ptr<c10::Event> issue_on_side_stream(const DeviceStreams& streams, Trace::Track track,
                                                 const std::string& span_name, Issue&& issue,
                                                 const c10::Event* after = nullptr) {
  std::optional<c10::Stream> side;
  if (streams.active())
    side = track == Trace::Track::AllGather       ? streams.all_gather()
           : track == Trace::Track::ReduceScatter ? streams.reduce_scatter()
                                                  : streams.all_reduce();
  std::optional<c10::StreamGuard> on_side_stream;
  if (side) {
    streams.wait(*side, streams.compute());
    if (after) streams.wait(*side, *after);
    on_side_stream.emplace(*side);
  }
  // A user's torch.profiler sees the issue as a range of its own (nothing to pay when none runs).
  RECORD_USER_SCOPE("fsdp::" + span_name);
  const int span = Trace::get().begin(span_name, track, side);
  issue();
  Trace::get().end(span, side);
  return side ? streams.record(*side) : nullptr;
}

// "a + b + c": the groups of one coalesced collective.
inline std::string bucket_label(const std::vector<GroupParams*>& groups) {
  std::string label;
  for (const GroupParams* g : groups) label += (label.empty() ? "" : " + ") + g->label();
  return label;
}

}  // namespace fsdp
