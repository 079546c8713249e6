#include "fsdp/launch.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "comm/process_group_communicator.h"
#ifdef FSDP_WITH_MPI
#include "comm/mpi_communicator.h"
#endif
#ifdef FSDP_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/nccl_communicator.h"
#endif

namespace fsdp {
namespace {

std::mutex g_mutex;
std::shared_ptr<Communicator> g_default;

// `comm` becomes the default communicator (init, init_from_process_group).
std::shared_ptr<Communicator> make_default(std::shared_ptr<Communicator> comm) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_default = comm;
  return comm;
}

int parse_int(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || v < INT32_MIN || v > INT32_MAX)
    throw std::invalid_argument(std::string("fsdp: launch variable ") + name + "='" + value +
                                "' is not an integer");
  return static_cast<int>(v);
}

// MASTER_PORT's value: an integer that is a TCP port.
int parse_port(const char* value) {
  const int port = parse_int("MASTER_PORT", value);
  if (port < 1 || port > 65535)
    throw std::invalid_argument("fsdp: MASTER_PORT=" + std::to_string(port) + " is not a TCP port (1-65535)");
  return port;
}

std::chrono::milliseconds timeout_from(const InitOptions& options) {
  if (options.timeout) return *options.timeout;
  if (const char* s = std::getenv("FSDP_TIMEOUT_S")) {
    char* end = nullptr;
    double seconds = std::strtod(s, &end);
    if (end == s || *end != '\0' || seconds <= 0)
      throw std::invalid_argument(std::string("fsdp: FSDP_TIMEOUT_S='") + s +
                                  "' must be a positive number of seconds");
    return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
  }
  return std::chrono::minutes(5);
}

bool cuda_usable() { return at::hasCUDA() && at::detail::getCUDAHooks().deviceCount() > 0; }

#ifdef FSDP_WITH_NCCL
// Rank 0's NCCL id reaches the others through a TCPStore at MASTER_ADDR:PORT
// (torchrun-style launch: rank 0 serves it, or torchrun's agent already does) or
// MPI_Bcast (mpirun). The store must outlive the
// exchange on every rank, so it lives as long as the process.
ncclUniqueId exchange_nccl_id(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  ncclUniqueId id{};
  if (env.rank == 0) id = make_nccl_unique_id();
  if (env.world_size == 1) return id;
  if (!env.master_addr.empty()) {
    static std::shared_ptr<c10d::TCPStore> store;
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(env.master_port);
    opts.isServer = env.rank == 0 && !env.agent_store;
    opts.numWorkers = env.world_size;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    store = std::make_shared<c10d::TCPStore>(env.master_addr, opts);
    const std::string key = "fsdp/nccl_unique_id/" + std::to_string(env.restart_count);
    if (env.rank == 0) {
      std::vector<uint8_t> bytes(sizeof(id));
      std::memcpy(bytes.data(), &id, sizeof(id));
      store->set(key, bytes);
    } else {
      auto bytes = store->get(key);
      if (bytes.size() != sizeof(id))
        throw CollectiveError("fsdp: NCCL id from the store at " + env.master_addr + " is corrupt");
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    return id;
  }
#ifdef FSDP_WITH_MPI
  ensure_mpi_initialized();
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  return id;
#else
  throw std::invalid_argument(
      "fsdp: this build has no MPI, so under mpirun its ranks meet through a store: set MASTER_ADDR and "
      "MASTER_PORT (rank 0's host and a free port), or launch with torchrun or fsdp-run");
#endif
}
#endif

std::shared_ptr<Communicator> make_communicator(Backend backend, const LaunchEnv& env,
                                                const InitOptions& options) {
  auto timeout = timeout_from(options);
  if (backend == Backend::Mpi) {
#ifndef FSDP_WITH_MPI
    throw std::invalid_argument(
        "fsdp: this build has no MPI backend (configured without MPI: -DFSDP_WITH_MPI=OFF, or CMake found "
        "none), and CPU ranks need it. Install OpenMPI's development files (Debian: libopenmpi-dev) and "
        "build again, or run on GPUs (NCCL)");
#else
    if (env.launcher == LaunchEnv::Launcher::Torchrun || env.launcher == LaunchEnv::Launcher::Pmi)
      throw std::invalid_argument(
          "fsdp: the CPU (MPI) backend needs processes started by mpirun (OpenMPI's, or srun); " +
          std::string(env.launcher == LaunchEnv::Launcher::Pmi ? "PMI_RANK/PMI_SIZE (MPICH's or Intel MPI's launcher)"
                                                               : "RANK/WORLD_SIZE") +
          " alone cannot connect its MPI processes. Launch with `mpirun -n N PROGRAM` or `fsdp-run -n N "
          "PROGRAM` (which uses mpirun when there is no GPU).");
    auto comm = std::make_shared<MpiCommunicator>(options.communicator_name, timeout);
    if (comm->world_size() != env.world_size || comm->rank() != env.rank)
      throw std::invalid_argument("fsdp: MPI sees rank " + std::to_string(comm->rank()) + " of " +
                                  std::to_string(comm->world_size()) +
                                  " but the launch environment says rank " +
                                  std::to_string(env.rank) + " of " +
                                  std::to_string(env.world_size));
    return comm;
#endif
  }
#ifdef FSDP_WITH_NCCL
  if (!cuda_usable())
    throw std::invalid_argument("fsdp: the NCCL backend needs a GPU, and CUDA sees none");
  int gpus = at::detail::getCUDAHooks().deviceCount();
  if (env.local_rank >= gpus)
    throw std::invalid_argument("fsdp: LOCAL_RANK " + std::to_string(env.local_rank) +
                                " has no GPU: this node has " + std::to_string(gpus) +
                                ". Start at most one process per GPU.");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(env.local_rank));
  if (env.world_size > 1 && env.master_addr.empty() && env.launcher != LaunchEnv::Launcher::Mpirun)
    throw std::invalid_argument(
        "fsdp: the launcher says there are " + std::to_string(env.world_size) +
        " ranks but not where they meet: set MASTER_ADDR and MASTER_PORT (rank 0's host and a free port), "
        "or launch with torchrun, OpenMPI's mpirun or fsdp-run");
  ncclUniqueId id = exchange_nccl_id(env, timeout);
  return std::make_shared<NcclCommunicator>(env.rank, env.world_size, env.local_rank, id,
                                            options.communicator_name, timeout);
#else
  throw std::invalid_argument(
      "fsdp: this build has no NCCL backend (torch without CUDA, or NCCL not found at configure "
      "time)");
#endif
}

// The first host of a SLURM node list ("gpu[07-08,12],cpu1" -> "gpu07").
std::string first_host(const std::string& nodes) {
  const auto open = nodes.find('[');
  const auto comma = nodes.find(',');
  if (open == std::string::npos || (comma != std::string::npos && comma < open)) return nodes.substr(0, comma);
  const auto close = nodes.find(']', open);
  const auto first_end = nodes.find_first_of(",-]", open + 1);
  const std::string suffix = close == std::string::npos ? "" : nodes.substr(close + 1, nodes.find(',', close) - close - 1);
  return nodes.substr(0, open) + nodes.substr(open + 1, first_end - open - 1) + suffix;
}

// srun's or a PMI launcher's (MPICH's mpiexec, Intel MPI) variables, where neither mpirun's nor
// torchrun's are set. GPU ranks meet through a store at MASTER_ADDR:MASTER_PORT: under srun by
// default the step's first node (where task 0 runs) and a port from the job id; a PMI launcher
// names no such place, so the user must. The batch script of an allocation of several tasks (no
// srun step) is refused: its one process is not the job's ranks.
void read_scheduler_launch(const std::function<const char*(const char*)>& get, LaunchEnv& env) {
  const auto number = [&](const char* name) { return parse_int(name, get(name)); };
  if (get("SLURM_PROCID")) {
    if (!get("SLURM_STEP_NUM_TASKS")) {
      if (get("SLURM_NTASKS") && number("SLURM_NTASKS") > 1)
        throw std::invalid_argument(
            std::string("fsdp: SLURM_NTASKS=") + get("SLURM_NTASKS") + " but this process was not started by srun "
            "(no SLURM_STEP_NUM_TASKS): start the ranks with `srun PROGRAM`, or run one process with SLURM_NTASKS unset");
      return;  // an allocation's batch script with one task: one process
    }
    env.launcher = LaunchEnv::Launcher::Slurm;
    env.rank = number("SLURM_PROCID");
    env.world_size = number("SLURM_STEP_NUM_TASKS");
    env.local_rank = get("SLURM_LOCALID") ? number("SLURM_LOCALID") : 0;
    if (const char* per_node = get("SLURM_STEP_TASKS_PER_NODE"))  // "4(x2),3": the first node's count
      env.local_world_size = std::max(1, std::atoi(per_node));
    const char* nodes = get("SLURM_STEP_NODELIST") ? get("SLURM_STEP_NODELIST") : get("SLURM_JOB_NODELIST");
    env.master_addr = get("MASTER_ADDR") ? get("MASTER_ADDR") : nodes ? first_host(nodes) : "";
    env.master_port = get("MASTER_PORT") ? parse_port(get("MASTER_PORT"))
                      : get("SLURM_JOB_ID") ? 29500 + number("SLURM_JOB_ID") % 1000 : 29500;
  } else if (get("PMI_RANK") || get("PMI_SIZE")) {
    if (!get("PMI_RANK") || !get("PMI_SIZE"))
      throw std::invalid_argument(std::string("fsdp: ") + (get("PMI_RANK") ? "PMI_SIZE" : "PMI_RANK") +
                                  " is not set, but " + (get("PMI_RANK") ? "PMI_RANK" : "PMI_SIZE") +
                                  " is: a PMI launcher sets both");
    env.launcher = LaunchEnv::Launcher::Pmi;
    env.rank = number("PMI_RANK");
    env.world_size = number("PMI_SIZE");
    env.local_rank = get("MPI_LOCALRANKID") ? number("MPI_LOCALRANKID") : 0;
    env.local_world_size = get("MPI_LOCALNRANKS") ? number("MPI_LOCALNRANKS") : 1;
    if (get("MASTER_ADDR")) {
      env.master_addr = get("MASTER_ADDR");
      if (!get("MASTER_PORT"))
        throw std::invalid_argument("fsdp: MASTER_PORT is not set, but MASTER_ADDR is (rank 0 listens there)");
      env.master_port = parse_port(get("MASTER_PORT"));
    }
  }
}

}  // namespace

LaunchEnv parse_launch_env(const std::function<const char*(const char*)>& getenv) {
  auto get = [&](const char* name) -> const char* {
    const char* v = getenv(name);
    return v && *v ? v : nullptr;
  };
  auto need = [&](const char* name, const char* why) -> const char* {
    const char* v = get(name);
    if (!v)
      throw std::invalid_argument(std::string("fsdp: ") + name + " is not set, " + why +
                                  ". Launch with torchrun, mpirun or fsdp-run, which set it.");
    return v;
  };
  LaunchEnv env;
  const bool torchrun = get("RANK") || get("WORLD_SIZE");
  const bool mpirun = get("OMPI_COMM_WORLD_RANK") != nullptr;
  if (mpirun) {
    env.launcher = LaunchEnv::Launcher::Mpirun;
    env.rank = parse_int("OMPI_COMM_WORLD_RANK", get("OMPI_COMM_WORLD_RANK"));
    env.world_size = parse_int("OMPI_COMM_WORLD_SIZE",
                               need("OMPI_COMM_WORLD_SIZE", "but OMPI_COMM_WORLD_RANK is"));
    const char* local = get("OMPI_COMM_WORLD_LOCAL_RANK");
    env.local_rank = local ? parse_int("OMPI_COMM_WORLD_LOCAL_RANK", local) : env.rank;
    const char* local_size = get("OMPI_COMM_WORLD_LOCAL_SIZE");
    env.local_world_size = local_size ? parse_int("OMPI_COMM_WORLD_LOCAL_SIZE", local_size) : env.world_size;
  }
  if (torchrun) {
    int rank = parse_int("RANK", need("RANK", "but WORLD_SIZE is"));
    int world = parse_int("WORLD_SIZE", need("WORLD_SIZE", "but RANK is"));
    if (mpirun && (rank != env.rank || world != env.world_size))
      throw std::invalid_argument(
          "fsdp: contradictory launch environment: RANK=" + std::to_string(rank) +
          " WORLD_SIZE=" + std::to_string(world) + " but mpirun says OMPI_COMM_WORLD_RANK=" +
          std::to_string(env.rank) + " OMPI_COMM_WORLD_SIZE=" + std::to_string(env.world_size) +
          ". Unset RANK/WORLD_SIZE under mpirun, or make them agree.");
    if (!mpirun) {
      env.launcher = LaunchEnv::Launcher::Torchrun;
      env.rank = rank;
      env.world_size = world;
      const char* local = world > 1 ? need("LOCAL_RANK", "but RANK and WORLD_SIZE are")
                                    : get("LOCAL_RANK");
      env.local_rank = local ? parse_int("LOCAL_RANK", local) : 0;
      const char* local_size = get("LOCAL_WORLD_SIZE");
      env.local_world_size = local_size ? parse_int("LOCAL_WORLD_SIZE", local_size) : world;
      const char* agent = get("TORCHELASTIC_USE_AGENT_STORE");
      env.agent_store = agent && std::string(agent) == "True";
      const char* restarts = get("TORCHELASTIC_RESTART_COUNT");
      env.restart_count = restarts ? parse_int("TORCHELASTIC_RESTART_COUNT", restarts) : 0;
    }
    if (world > 1 || get("MASTER_ADDR")) {
      const char* why = "but RANK and WORLD_SIZE are (rank 0 listens there)";
      env.master_addr = mpirun && !get("MASTER_ADDR") ? "" : need("MASTER_ADDR", why);
      if (!env.master_addr.empty()) {
        env.master_port = parse_port(need("MASTER_PORT", why));
      }
    }
  }
  if (!mpirun && !torchrun) read_scheduler_launch(get, env);
  if (env.world_size < 1)
    throw std::invalid_argument("fsdp: world size " + std::to_string(env.world_size) +
                                " must be at least 1");
  if (env.rank < 0 || env.rank >= env.world_size)
    throw std::invalid_argument("fsdp: rank " + std::to_string(env.rank) +
                                " is outside the world of " + std::to_string(env.world_size) +
                                " processes (0.." + std::to_string(env.world_size - 1) + ")");
  if (env.local_rank < 0 || env.local_rank > env.rank)
    throw std::invalid_argument("fsdp: local rank " + std::to_string(env.local_rank) +
                                " must be between 0 and the global rank " +
                                std::to_string(env.rank));
  return env;
}

LaunchEnv launch_env_from_process() {
  return parse_launch_env([](const char* name) { return std::getenv(name); });
}

std::shared_ptr<Communicator> init(const InitOptions& options) {
  LaunchEnv env = launch_env_from_process();
  Backend backend = options.backend;
  if (backend == Backend::Auto) backend = cuda_usable() ? Backend::Nccl : Backend::Mpi;
  return make_default(make_communicator(backend, env, options));
}

std::shared_ptr<Communicator> init_from_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                      const InitOptions& options) {
  return make_default(std::make_shared<ProcessGroupCommunicator>(group, options.communicator_name, timeout_from(options)));
}

std::shared_ptr<Communicator> default_communicator() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_default)
    throw std::logic_error(
        "fsdp: no communicator: call fsdp::init() before fully_shard, or pass "
        "ShardOptions::comm");
  return g_default;
}

void shutdown() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_default.reset();
}

std::string error_text(const std::exception& e) {
  const char* keep = std::getenv("FSDP_BACKTRACE");
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&e); torch_error && !(keep && *keep == '1'))
    return torch_error->what_without_backtrace();
  return e.what();
}

void abort_job(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
#ifdef FSDP_WITH_MPI
  int finalized = 0, processes = 1;
  if (mpi_is_initialized() && (MPI_Finalized(&finalized), !finalized) &&
      (MPI_Comm_size(MPI_COMM_WORLD, &processes), processes > 1))
    MPI_Abort(MPI_COMM_WORLD, 1);  // mpirun stops the others
#endif
  std::exit(1);
}

}  // namespace fsdp
