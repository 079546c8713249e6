// Process-wide scheduling knobs of the FSDP runtime, and what it counted.
#pragma once

#include <cstddef>
#include <string>

namespace fsdp {

/// The runtime's scheduling knobs, process-wide (set_runtime_options). Each trades memory for
/// overlap: more prefetch and higher caps overlap more communication and hold more buffers.
struct RuntimeOptions {
  /// Groups all-gathered ahead of use, following the order recorded in the
  /// previous step (forward and backward separately). 0: no prefetch.
  int prefetch_depth = 1;
  /// All-gathers the CPU may issue before the GPU has released the memory of
  /// earlier ones; past it the CPU waits on the oldest release instead of
  /// letting the allocator grow. 0: unlimited.
  int max_inflight_allgathers = 2;
  /// Reduce-scatters (and their gradient buffers) in flight; past it the CPU
  /// waits for the oldest. 0: unlimited.
  int max_inflight_reduce_scatters = 2;
  /// Bucketing: a group smaller than this (unsharded, in MB) is all-gathered
  /// together with the small groups expected next (past larger groups, which
  /// go alone), and reduce-scatters wait to go out together until this many
  /// MB are ready (a large group takes the waiting ones with it), in one
  /// coalesced collective each. 0: every group on its own.
  double bucket_mb = 0;
  /// bucket_mb in bytes.
  size_t bucket_bytes() const { return static_cast<size_t>(bucket_mb * 1024.0 * 1024.0); }
  /// With bucketing: how many groups may join the reduce-scatter bucket after its first before it
  /// goes out even if not full (a cap on the backward compute that gradients wait through, and so
  /// on the compute between reduce-scatters). 0: until it is full or backward ends.
  int reduce_bucket_max_wait = 0;
  /// With the optimizer step in backward (set_step_in_backward), an offloaded group's step runs on
  /// a host thread of the root's while backward's thread goes on issuing the GPU's work; this
  /// many steps may be pending there (each holds the group's gradients in host memory) before
  /// backward waits for the oldest. 0: steps run on backward's thread, one group at a time.
  int max_pending_host_steps = 2;

  /// The same knobs everywhere.
  bool operator==(const RuntimeOptions& o) const {
    return prefetch_depth == o.prefetch_depth && max_inflight_allgathers == o.max_inflight_allgathers &&
           max_inflight_reduce_scatters == o.max_inflight_reduce_scatters && bucket_mb == o.bucket_mb &&
           reduce_bucket_max_wait == o.reduce_bucket_max_wait && max_pending_host_steps == o.max_pending_host_steps;
  }
};

/// Takes effect from the next collective; not thread-safe (call between steps). Throws
/// std::invalid_argument for negative values.
void set_runtime_options(const RuntimeOptions& options);
/// The options in force.
RuntimeOptions runtime_options();

/// What the runtime counted (runtime_stats).
struct RuntimeStats {
  long allgather_waits = 0;       ///< times the CPU blocked on max_inflight_allgathers
  long reduce_scatter_waits = 0;  ///< times the CPU blocked on max_inflight_reduce_scatters
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
