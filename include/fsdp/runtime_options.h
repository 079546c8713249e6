// Process-wide scheduling knobs of the FSDP runtime, and what it counted.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace fsdp {

/// The runtime's scheduling knobs, process-wide (set_runtime_options). Each trades memory for
/// overlap: more prefetch and higher caps overlap more communication and hold more buffers. What
/// each means is its line in for_each_runtime_option below (fsdp-train's --help prints the same).
struct RuntimeOptions {
  /// @name The knobs
  ///@{
  int prefetch_depth = 1;  ///< each knob's meaning: its line in for_each_runtime_option
  int max_inflight_allgathers = 2;
  int max_inflight_reduce_scatters = 2;
  double bucket_mb = 0;
  int reduce_bucket_max_wait = 0;
  int max_pending_host_steps = 2;
  ///@}

  /// bucket_mb in bytes.
  size_t bucket_bytes() const { return static_cast<size_t>(bucket_mb * 1024.0 * 1024.0); }
  /// The same knobs everywhere.
  bool operator==(const RuntimeOptions& o) const;
};

/// Each knob of RuntimeOptions once, for the code that treats them alike (comparison, the range
/// check, the Python binding, fsdp-train's flags): visit(name, member, meaning) in declaration
/// order; `meaning` is a line of help that says what 0 means. A new knob is one line here.
template <class Visit>
void for_each_runtime_option(Visit&& visit) {
  visit("prefetch_depth", &RuntimeOptions::prefetch_depth,
        "groups all-gathered ahead of use, following the order recorded in the previous step (forward "
        "and backward apart); 0 = no prefetch");
  visit("max_inflight_allgathers", &RuntimeOptions::max_inflight_allgathers,
        "all-gathers the CPU may issue before the GPU has released the memory of earlier ones (past it "
        "the CPU waits for the oldest release instead of the allocator growing); 0 = unlimited");
  visit("max_inflight_reduce_scatters", &RuntimeOptions::max_inflight_reduce_scatters,
        "reduce-scatters (and their gradient buffers) in flight before the compute stream waits for the "
        "oldest (the CPU does not); 0 = unlimited");
  visit("bucket_mb", &RuntimeOptions::bucket_mb,
        "a group below this unsharded size (MB) is all-gathered with the small groups expected next (past "
        "larger ones), and reduce-scatters wait until this many MB are ready (a large group takes the "
        "waiting ones along), one coalesced collective each; 0 = every group alone");
  visit("reduce_bucket_max_wait", &RuntimeOptions::reduce_bucket_max_wait,
        "with bucketing: groups that may join the reduce-scatter bucket after its first before it goes out "
        "unfilled (a cap on the compute between reduce-scatters); 0 = until it is full or backward ends");
  visit("max_pending_host_steps", &RuntimeOptions::max_pending_host_steps,
        "with CPU offload and the optimizer step in backward: host steps that may wait or run on the root's "
        "step thread while backward goes on issuing GPU work (each holds its group's gradients in host "
        "memory); 0 = step on backward's thread, one group at a time");
}

inline bool RuntimeOptions::operator==(const RuntimeOptions& o) const {
  bool same = true;
  for_each_runtime_option([&](const char*, auto member, const char*) { same = same && this->*member == o.*member; });
  return same;
}

/// Throws std::invalid_argument, naming `caller` and the knob, for a negative value.
inline void check_runtime_options(const RuntimeOptions& options, const std::string& caller) {
  for_each_runtime_option([&](const char* name, auto member, const char*) {
    if (options.*member < 0)
      throw std::invalid_argument(caller + ": " + name + " is " + std::to_string(options.*member) +
                                  "; it must be 0 or more");
  });
}

/// Takes effect from the next collective; not thread-safe (call between steps). Throws
/// std::invalid_argument for negative values.
void set_runtime_options(const RuntimeOptions& options);
/// The options in force.
RuntimeOptions runtime_options();

/// What the runtime counted (runtime_stats).
struct RuntimeStats {
  long allgather_waits = 0;       ///< times the CPU blocked on max_inflight_allgathers
  long reduce_scatter_waits = 0;  ///< times the compute stream waited on max_inflight_reduce_scatters
  long host_step_waits = 0;       ///< times backward blocked on max_pending_host_steps
  long prefetches = 0;            ///< all-gathers issued ahead of use
  long order_departures = 0;      ///< passes whose order differed from the recorded one
  long all_gathers = 0;           ///< all-gather collectives issued (a bucket counts once)
  long reduce_scatters = 0;       ///< reduce-scatter collectives issued (a bucket counts once)
};

/// Totals since the process started (subtract two readings for one step).
RuntimeStats runtime_stats();

/// Chrome trace (Perfetto, chrome://tracing) of this rank's forward and
/// backward compute, all-gather and reduce-scatter spans, one track per
/// stream. start_trace() begins recording; write_trace() waits for the device,
/// writes the JSON and stops. Uses the default communicator's device and rank.
void start_trace();
void write_trace(const std::string& path);

}  // namespace fsdp
