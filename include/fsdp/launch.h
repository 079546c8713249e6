// Process-group set-up: who am I, how many are we, and the communicator that
// joins us. These launchers are understood, in this order of precedence:
//   mpirun          OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
//   torchrun-style  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   fsdp-run        sets the torchrun variables (GPUs) or runs mpirun (CPU)
//   srun (SLURM)    SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID; GPU ranks meet at
//                   MASTER_ADDR:MASTER_PORT, by default the step's first node and a port from
//                   the job id
//   MPICH / Intel MPI (PMI)  PMI_RANK, PMI_SIZE, MPI_LOCALRANKID; GPU ranks need MASTER_ADDR
//                   and MASTER_PORT
// and no launcher at all means a single process. An environment that says there are several
// processes but gives no way to join them is refused, never run as one process alone.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <c10/util/intrusive_ptr.h>

#include "fsdp/communicator.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fsdp {

/// What the launcher told this process (parse_launch_env).
struct LaunchEnv {
  /// Who started the process: nobody (one process), torchrun-style variables, or mpirun.
  enum class Launcher { Single, Torchrun, Mpirun, Slurm, Pmi };
  Launcher launcher = Launcher::Single;  ///< who started the process
  int rank = 0;                          ///< this process among all
  int world_size = 1;                    ///< processes in all
  int local_rank = 0;                    ///< this process among those of its machine (its GPU)
  int local_world_size = 1;              ///< processes on this machine (1 where the launcher says not)
  std::string master_addr;  ///< where GPU ranks meet (torchrun-style, srun, PMI); empty for mpirun
  int master_port = 0;      ///< the store's port (torchrun-style)
  /// Under torchrun its agent already serves the store at MASTER_ADDR:MASTER_PORT
  /// (TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 too, joins it as a client. The
  /// restart count (TORCHELASTIC_RESTART_COUNT) keeps a restarted job's keys apart from the last.
  bool agent_store = false;
  int restart_count = 0;  ///< TORCHELASTIC_RESTART_COUNT (see agent_store)
};

/// Reads the launch variables through `getenv` (tests pass a fake). Throws
/// std::invalid_argument naming the variable and the fix when they are
/// missing, malformed or contradict each other.
LaunchEnv parse_launch_env(const std::function<const char*(const char*)>& getenv);
/// parse_launch_env of this process's environment.
LaunchEnv launch_env_from_process();

/// The communicator's backend: MPI (CPU tensors), NCCL (GPUs), or NCCL where CUDA is available.
enum class Backend { Auto, Mpi, Nccl };

/// What init() makes.
struct InitOptions {
  Backend backend = Backend::Auto;  ///< Auto: NCCL when CUDA is available, else MPI
  /// How long a collective may wait for its peers; FSDP_TIMEOUT_S overrides the default.
  std::optional<std::chrono::milliseconds> timeout;
  std::string communicator_name = "world";  ///< how errors name the world communicator
};

/// Creates the world communicator from the launch environment and makes it the
/// default one fully_shard uses. With NCCL it also selects cuda:LOCAL_RANK.
std::shared_ptr<Communicator> init(const InitOptions& options = {});
/// Makes the default communicator, as init() does, over a torch.distributed process group the
/// program already made, for CPU tensors: torch's Gloo, built into libtorch. How CPU ranks meet
/// without mpirun (under torchrun: the Python front end's `fsdpcpp.init(backend="gloo")`). Takes
/// options' timeout and communicator name; its collectives are Gloo's, slower than MPI's, and it cannot
/// be split into a mesh's communicators (HSDP).
std::shared_ptr<Communicator> init_from_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                      const InitOptions& options = {});
/// The communicator made by init(); throws if init() was not called.
std::shared_ptr<Communicator> default_communicator();
/// Forgets the default communicator (it is destroyed once nothing else holds it).
void shutdown();

/// An exception's message for a person: libtorch's errors without the C++ backtrace they carry
/// (set FSDP_BACKTRACE=1 to keep it, for debugging).
std::string error_text(const std::exception& e);

/// Prints `message` and ends every rank of the job: MPI_Abort under MPI (so
/// mpirun stops the others), exit(1) otherwise. For fatal errors in tools.
[[noreturn]] void abort_job(const std::string& message);

}  // namespace fsdp
