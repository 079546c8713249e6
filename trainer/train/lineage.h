// A --save-dir's checkpoints and the runs that wrote them. A run's id is drawn by a fresh run and
// kept by every run resumed from its checkpoints: its lineage. Each checkpoint records its run
// id and the step of the checkpoint its run resumed from ("parent"), so the trainer can tell its
// own lineage from another run's, and a branch a resume from an older step abandoned.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace fsdp::train {

struct SavedCheckpoint {
  std::string path;  // DIR/step-N
  int step = 0;
  std::string run;  // "" where the metadata cannot be read or names no run
};

// The complete checkpoints (step-N holding metadata.bin) directly under `dir`, by step.
std::vector<SavedCheckpoint> saved_checkpoints(const std::string& dir);
// The run id a checkpoint's entries record ("" for none).
std::string run_of(const std::map<std::string, std::string>& extra);
// Those of `saved` that another run than `run` wrote (all of them when `run` is "").
std::vector<SavedCheckpoint> other_runs(const std::vector<SavedCheckpoint>& saved, const std::string& run);
// Run `run`'s checkpoints in `saved` (in step order) but its newest `keep`: what --keep-last removes.
std::vector<SavedCheckpoint> older_than_newest(const std::vector<SavedCheckpoint>& saved, const std::string& run,
                                               int keep);
// Moves run `run`'s checkpoints after step `step` in `dir` (the branch a resume from `step`
// leaves) into DIR/abandoned-after-step-N-<time>/, where no --resume takes them; returns that
// directory, or "" when there were none.
std::string set_aside_abandoned_branch(const std::string& dir, const std::string& run, int step);

}  // namespace fsdp::train
