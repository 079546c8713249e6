// Sharded checkpoints: every rank writes only its own rows, rank 0 the metadata, last; a
// checkpoint loads on any number of ranks (the rows are re-split), and is visible only once
// complete. The format is in src/checkpoint/checkpoint_format.h and docs/checkpoints.md.
//
//   fsdp::CheckpointState state = fsdp::model_state(*model);   // the parameters, by name
//   state.add_sharded("optimizer/" + name + "/exp_avg", moment, param);  // laid out like a parameter
//   state.add_replicated("optimizer/" + name + "/step", step);           // the same on every rank
//   state.extra["step"] = "120";                                  // bytes of the caller's own
//   fsdp::save_checkpoint("run/step-000120", state);             // collective
//   fsdp::load_checkpoint(fsdp::newest_checkpoint("run"), state); // collective, fills in place
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/communicator.h"
#include "fsdp/tensor_parallel.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

/// How a checkpoint names what is not a model parameter, the same from both front ends (offline
/// conversion leaves optimizer state out of an export by these): a buffer "buffer/NAME", optimizer
/// state "optimizer/PARAMETER/KEY" (the Python package's), or fsdp-train's FusedAdamW's
/// "adam.KEY.PARAMETER".
inline constexpr char kBufferPrefix[] = "buffer/";
inline constexpr char kOptimizerPrefix[] = "optimizer/";
inline constexpr char kAdamPrefix[] = "adam.";
/// Whether a checkpoint's entry `name` is optimizer state (under either optimizer prefix).
bool is_optimizer_state(const std::string& name);

/// Told the bytes this rank has moved so far and the bytes it moves in all, after each piece.
using ByteProgress = std::function<void(int64_t done, int64_t total)>;

/// What save_checkpoint writes and load_checkpoint fills: sharded tensors (each rank's rows),
/// replicated tensors and the caller's entries. Building it is local; saving and loading are
/// collective.
class CheckpointState {
 public:
  /// `local` holds this rank's rows of a tensor laid out like the sharded parameter `like` (the
  /// parameter itself, or an optimizer moment of it). Throws if `like` is not sharded. Under
  /// tensor parallelism (`like` a tp part, fsdp/tensor_parallel.h) the checkpoint holds the full
  /// tensor, each rank's block placed where its elements lie, and loads on any (dp, tp) layout; a
  /// parameter every tp rank holds alike is saved by the first of them.
  void add_sharded(const std::string& name, at::Tensor local, const at::Tensor& like);
  /// A tensor that is the same on every rank (step counts, scalars); saved from rank 0.
  void add_replicated(const std::string& name, at::Tensor value);
  /// The caller's own entries (a trainer's step, data position): saved and loaded as bytes.
  std::map<std::string, std::string> extra;
  /// Called on this rank's thread as save_checkpoint writes its file (each tensor) and as
  /// load_checkpoint reads its blocks (each block, both the checksum pass and the copy: the total
  /// counts both); start_checkpoint_save, whose thread writes beside training, does not call it.
  /// A progress line, say. Unset: nothing.
  ByteProgress progress;

  /// One sharded tensor as add_sharded recorded it.
  struct Sharded {
    std::string name;     ///< its name in the checkpoint
    at::Tensor local;     ///< this rank's elements (filled in place on load)
    HeldElements held;    ///< where they lie in the whole tensor (its full_shape)
    /// The ranks that hold the tensor once between them and save it: the parameter group's, or
    /// under tensor parallelism a replica's (Mesh::replica).
    Communicator* comm = nullptr;
    Communicator* replicate = nullptr;  ///< HSDP: its replicas (the first one saves)
    bool saves = true;  ///< false: another tp rank saves the same elements
  };
  const std::vector<Sharded>& sharded() const { return sharded_; }  ///< in the order added
  /// Whether the sharded tensors are saved with each rank's place in them (tensor parallelism).
  bool placed() const { return replica_ != nullptr; }
  /// The replicated tensors by name, in the order added.
  const std::vector<std::pair<std::string, at::Tensor>>& replicated() const { return replicated_; }

 private:
  std::vector<Sharded> sharded_;
  std::vector<std::pair<std::string, at::Tensor>> replicated_;
  // Once a tp part is added: its tp ranks and replica, which every entry is saved over.
  Communicator* tp_ = nullptr;
  Communicator* replica_ = nullptr;
};

/// The sharded parameters of `root` (fully_shard applied) under their names.
CheckpointState model_state(torch::nn::Module& root);

/// Collective over the sharded tensors' communicator (HSDP: over all replicas, the first one
/// writing; the checkpoint is that of one replica's ranks and loads like any other). Writes `dir`
/// (its parent must exist) through `dir`.tmp, renamed once every file and the metadata are on
/// disk; replaces an existing `dir`.
void save_checkpoint(const std::string& dir, const CheckpointState& state);
/// A save whose files are being written on a thread of their own (start_checkpoint_save).
class CheckpointWrite {
 public:
  /// Collective, at a point every rank reaches (the next save, the end of training): waits for
  /// every rank's file, then publishes `dir` as save_checkpoint does (metadata last, renamed into
  /// place). Throws on every rank if any rank's write failed. Once.
  void finish();
  /// The checkpoint directory it publishes.
  const std::string& dir() const { return dir_; }
  /// Waits for the thread; a write never finished leaves `dir`.tmp, which newest_checkpoint skips.
  ~CheckpointWrite();
  CheckpointWrite(const CheckpointWrite&) = delete;
  CheckpointWrite& operator=(const CheckpointWrite&) = delete;

 private:
  friend std::unique_ptr<CheckpointWrite> start_checkpoint_save(const std::string&, const CheckpointState&);
  CheckpointWrite(std::string dir, const CheckpointState& state);
  struct Writing;
  std::string dir_;
  Communicator* comm_;
  Communicator* replicate_;
  std::unique_ptr<Writing> writing_;  // on the ranks that write (HSDP: the first replica's)
  bool finished_ = false;
};

/// Collective. save_checkpoint in two halves: copies this rank's rows of every tensor (and the
/// replicated tensors and `extra`) to host memory now, so the state may change as soon as it
/// returns, and writes them on a thread; CheckpointWrite::finish() publishes the checkpoint.
/// Host memory: a copy of this rank's sharded state until its file is written.
std::unique_ptr<CheckpointWrite> start_checkpoint_save(const std::string& dir, const CheckpointState& state);
/// Collective. Fills every tensor of `state` in place from `dir`, saved on any world size, and
/// sets `state.extra`. Throws on every rank if any rank finds the checkpoint unusable (missing or
/// truncated files, a checksum mismatch, another model's names, shapes or dtypes), naming the file
/// and the problem. Everything is checked before anything is copied: after a failed load the
/// tensors are as they were. `leave_out`: a name prefix (the Python package's "optimizer/"): the
/// checkpoint's tensors under it that `state` does not hold are left out instead of refused (a
/// model loaded without its optimizer). Returns the names left out.
std::vector<std::string> load_checkpoint(const std::string& dir, CheckpointState& state,
                                         const std::string& leave_out = "");
/// The newest complete checkpoint under `parent` (subdirectories named step-N holding
/// metadata.bin; interrupted saves, `*.tmp`, are skipped), `parent` itself where it is a complete
/// checkpoint, or "" if none.
std::string newest_checkpoint(const std::string& parent);
/// The caller's entries (`CheckpointState::extra`) of the checkpoint in `dir`, read from its
/// metadata alone: local, no communicator, no tensor read. Throws naming the file if it is
/// missing or damaged.
std::map<std::string, std::string> checkpoint_extra(const std::string& dir);
/// Every tensor of the checkpoint in `dir` whole, one at a time, in the metadata's order (the
/// sharded ones, then the replicated), each block's checksum checked before it is handed over:
/// local (no communicator, no model, any world size it was saved on), for offline conversion
/// (`python -m fsdpcpp.convert`). `visit(name, tensor)` gets a CPU tensor of its own. Throws
/// naming the file for a missing, truncated or damaged checkpoint.
void for_each_checkpoint_tensor(const std::string& dir,
                                const std::function<void(const std::string&, const at::Tensor&)>& visit);
/// "step-000120": how save directories are named for newest_checkpoint.
std::string checkpoint_name(int64_t step);
/// The step a directory name says ("step-000120" -> 120; "step-7" -> 7), or -1 for any other name.
int64_t checkpoint_step(const std::string& name);

}  // namespace fsdp
