// One line that a long wait updates on a terminal (a checkpoint's save or load, an export, an
// import of weights): "fsdp-train: saving ck/step-000020: 45% of 12.30 GB, 1.90 GB/s, 0:05 left",
// at most twice a second, erased when it ends; the caller prints the outcome. Nothing where
// stdout is not a terminal (fsdp-run says when the ranks' pipes reach one) or on other ranks.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "fsdp/sharded_checkpoint.h"

namespace fsdp::train {

class ProgressLine {
 public:
  // `what`: "saving DIR"; `lead`: this rank prints.
  ProgressLine(std::string what, bool lead);
  ~ProgressLine();  // end()
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Updates the line: `done` of `total` bytes.
  void update(int64_t done, int64_t total);
  // update() as the callback a reader or writer takes; valid while this line lives.
  ByteProgress callback();
  // Erases the line (then the caller prints its outcome). Once; later updates draw nothing.
  void end();
  // "12.30 GB at 1.90 GB/s" (MB below a gigabyte): the bytes last told and their rate since the
  // line was made.
  std::string moved() const;

 private:
  std::string what_;
  bool shown_;  // a terminal on this rank
  bool drawn_ = false;
  int64_t done_ = 0;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace fsdp::train
