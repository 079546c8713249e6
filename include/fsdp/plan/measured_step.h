// The cost model measured from one training step recorded with memory marks (shard/trace.h's
// recording, copied here without torch by the runtime: fsdp::finish_profiled_step).
//
// The step is recorded under profiling_schedule(): every recomputable group recomputed (the
// least memory, so the profile fits wherever training can), the root unsharded and every other
// group resharded after forward, no prefetch. Each recomputed group then shows all of its
// costs apart: its forward without saving (recompute_saved_bytes), its recompute (the forward
// with saving: saved_bytes, forward_peak_bytes, forward_ms), its backward after the recompute.
// The root's own compute is the part of its spans outside the other groups' (its head and
// embedding), less the all-gathers the compute stream waited for there.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/plan/cost_model.h"
#include "fsdp/plan/schedule.h"

namespace fsdp::plan {

/// A span of the recorded step; names as the runtime traces them: "forward L", "recompute L",
/// "backward L", "all-gather L", "reduce-scatter L" for a group labelled L.
struct RecordedSpan {
  std::string name;         ///< "forward #4 blocks.3", ...
  double start_ms = 0;      ///< device time of its start
  double end_ms = 0;        ///< device time of its end
  double host_start_ms = 0; ///< when the host issued its start
  double host_end_ms = 0;   ///< when the host issued its end
  int start_mark = -1;      ///< the memory mark at its start (into RecordedStep::marks)
  int end_mark = -1;        ///< the memory mark at its end
};

/// Bytes allocated at a point of the recorded step.
struct MemoryMark {
  int64_t allocated = 0;        ///< at the mark
  int64_t peak_since_last = 0;  ///< the most allocated since the previous mark
};

/// One training step as the runtime recorded it (fsdp::finish_profiled_step copies it here).
struct RecordedStep {
  std::vector<RecordedSpan> spans;  ///< in the order begun
  std::vector<MemoryMark> marks;  ///< marks[0]: the start of the step
  double step_ms = 0;             ///< wall time from the start of the forward to the optimizer's end
  /// Passes in the step (gradient accumulation); the recording then holds only the last, which
  /// starts with the earlier passes' sharded gradients (or unsynced sums) allocated, and step_ms
  /// must be the whole step's (an untraced one's).
  int micro_batches = 1;
  bool reduce_every_micro_batch = true;  ///< CostModel::reduce_every_micro_batch
  bool host_is_device = false;    ///< CPU training: the host's time is the compute time
};

/// What the runtime knows of a group without running it (GroupParams's sizes).
struct GroupShape {
  std::string name;   ///< "blocks.3"
  std::string label;  ///< its trace label, "#4 blocks.3"
  GroupMemory memory;  ///< its buffers, as the parameter group sizes them
  bool recomputable = true;       ///< whether the model can recompute it
  bool encloses_later = false;  ///< the root
};

/// The schedule a profiled step runs under (see above).
Schedule profiling_schedule(const std::vector<GroupShape>& groups);

/// Throws std::invalid_argument naming the span that is missing when the record does not hold a
/// step of these groups under profiling_schedule(groups). fixed_ms is what the groups do not
/// explain: the step's time less the simulator's prediction of it without fixed_ms.
CostModel measure_cost_model(const std::vector<GroupShape>& groups, const RecordedStep& step);

/// The schedule of the calibration step, recorded after the profiled one: profiling_schedule's
/// groups at prefetch depth 1, so that all-gathers and reduce-scatters run beside compute.
Schedule calibration_schedule(const std::vector<GroupShape>& groups);

/// Measures model.contention from a step recorded (memory marks not needed) under
/// calibration_schedule(groups): each collective's stretch is the time of those that ran beside
/// compute over their time alone in the profile; compute_slowdown is then the one value (in
/// [0, 4]) for which the simulator's replay of the calibration step takes its measured time,
/// with fixed_ms refitted to the profiled step at each trial. Throws std::invalid_argument when
/// the record holds no all-gather of these groups.
void calibrate_contention(CostModel& model, const std::vector<GroupShape>& groups, const RecordedStep& step);

}  // namespace fsdp::plan
