// Collective communication between the ranks of one communicator.
//
// Every operation is collective: all ranks of the communicator call it in the same
// order with tensors of the same size and dtype. CPU tensors go through MPI,
// CUDA tensors through NCCL (on the caller's current CUDA stream).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp {

enum class ReduceOp { Sum, Avg };

/// A collective that did not complete in time, or was called wrongly.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Collective communication among the ranks of one communicator, over MPI (CPU tensors) or NCCL (CUDA
/// tensors, on the caller's current stream). Every operation is collective. Not thread-safe: one
/// thread issues a communicator's collectives (the runtime's hooks run on autograd's thread, one
/// at a time).
class Communicator {
 public:
  /// For backends: this rank's place among `world_size` ranks, named `name` in errors;
  /// collectives outliving `timeout` fail with CollectiveError.
  Communicator(int rank, int world_size, std::string name,
               std::chrono::milliseconds timeout);
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }              ///< this rank's index in the communicator
  int world_size() const { return world_size_; }  ///< the communicator's ranks
  const std::string& name() const { return name_; }  ///< how errors name it ("world", "world.replica0")
  std::chrono::milliseconds timeout() const { return timeout_; }  ///< how long a collective may take
  /// "mpi", "nccl" or "gloo" (a torch.distributed process group's, fsdp::init_from_process_group).
  virtual const char* backend() const = 0;
  /// The device of the tensors this communicator moves (cpu, or this rank's GPU).
  virtual at::Device device() const = 0;

  /// output (world * n elements) = concatenation of every rank's input (n elements).
  void all_gather(const at::Tensor& output, const at::Tensor& input);
  /// output (n elements) = this rank's chunk of the element-wise reduction of
  /// every rank's input (world * n elements).
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op);
  /// tensor = the element-wise reduction of every rank's tensor, in place.
  void all_reduce(const at::Tensor& tensor, ReduceOp op);
  /// tensor = rank `root`'s tensor, in place.
  void broadcast(const at::Tensor& tensor, int root);
  /// Returns once every rank has called it (waits for the device on GPUs).
  void barrier();
  /// Collective: how many ranks pass true (one small all-reduce, waited for). How ranks agree to
  /// stop together when one of them fails.
  int count_ranks(bool condition);
  /// Collective. The ranks passing the same `color` (>= 0) form a new communicator, ordered by
  /// `key` (ties by rank here), with this one's backend, device and timeout; `name` names it
  /// in errors. A timed barrier comes first, so a missing peer fails with this communicator's timeout
  /// instead of hanging in the backend's split.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name);
  /// Several independent collectives issued together (one NCCL group, or
  /// concurrent non-blocking MPI requests), completed together. `tag` names
  /// what is moved (e.g. the parameter groups) for the cross-rank check.
  void all_gather_coalesced(const std::vector<at::Tensor>& outputs,
                            const std::vector<at::Tensor>& inputs, const std::string& tag = "");
  /// The same for reduce-scatters.
  void reduce_scatter_coalesced(const std::vector<at::Tensor>& outputs,
                                const std::vector<at::Tensor>& inputs, ReduceOp op,
                                const std::string& tag = "");

  /// Debugging aid, off unless FSDP_CHECK_COLLECTIVES=1 (or set here): before
  /// every collective the ranks compare a hash of what they are about to issue
  /// (operation, sizes, dtypes, tag) and throw CollectiveError naming the
  /// first difference, instead of pairing mismatched collectives (a hang, or
  /// silently swapped data when the sizes agree). Costs one small all-gather
  /// and a wait for the device per collective.
  void set_check_collectives(bool on) { check_collectives_ = on; }

  /// "rank 1 of communicator 'world' (2 ranks, mpi)": for error messages.
  std::string describe() const;
  /// What a backend reports when a collective outlives the timeout.
  std::string timeout_message(const std::string& what) const;
  /// What ranks that issue different collectives look like, and how to find the first difference.
  static std::string mismatch_hint();

 protected:
  /// One all-gather or reduce-scatter: world_size x more elements on the
  /// gathered side (the output of an all-gather, the input of a reduce-scatter).
  struct Buffers {
    at::Tensor output;  ///< all-gather: world x the input; reduce-scatter: one rank's part
    at::Tensor input;   ///< all-gather: this rank's part; reduce-scatter: world x the output
  };
  /// "all_gather of 1536 bytes in 2 pieces (#3 Block)": how a backend names a batch (its inputs'
  /// total size, their count when more than one, and the tag) in its errors.
  static std::string describe_batch(const std::string& op, const std::vector<Buffers>& ops, const std::string& tag);
  static std::string bytes_of(const at::Tensor& t);  ///< "1024 bytes"
  /// Backends implement batches; the checked public calls above funnel here. `tag` (may be empty)
  /// goes into their errors: a rank that waits on a collective names what it was moving.
  virtual void do_all_gather(const std::vector<Buffers>& ops, const std::string& tag) = 0;
  virtual void do_reduce_scatter(const std::vector<Buffers>& ops, ReduceOp op,
                                 const std::string& tag) = 0;  ///< see do_all_gather
  virtual void do_all_reduce(const at::Tensor& tensor, ReduceOp op) = 0;  ///< see all_reduce
  virtual void do_broadcast(const at::Tensor& tensor, int root) = 0;      ///< see broadcast
  virtual void do_barrier() = 0;                                          ///< see barrier
  /// See split: the backend's split, after the barrier.
  virtual std::shared_ptr<Communicator> do_split(int color, int key, std::string name) = 0;

 private:
  void check_tensor(const at::Tensor& t, const char* op, const char* role) const;
  std::vector<Buffers> checked(const char* op, const std::vector<at::Tensor>& outputs,
                               const std::vector<at::Tensor>& inputs, bool output_gathered) const;
  /// `signature_of()` builds the collective's signature, only while checking.
  template <class Describe>
  void check_same_on_all_ranks(Describe&& signature_of);

  int rank_;
  int world_size_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  bool check_collectives_ = false;
  uint64_t collectives_issued_ = 0;
};

}  // namespace fsdp
