"""The process's communicator and the runtime's process-wide settings."""

import atexit
import ctypes
import ctypes.util
import os
import sys

import torch


def _load_mpi_globally():
    # Open MPI loads its transports as plugins that look for libmpi's symbols in the global
    # namespace; Python loads extensions with RTLD_LOCAL, so libmpi goes in first, globally.
    name = ctypes.util.find_library("mpi")
    if name:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass


_load_mpi_globally()
from . import _C  # noqa: E402  (after torch and libmpi)

version = _C.version
_info = None  # (rank, world size, device, backend) once init() ran


def init(backend: str = "auto", timeout_s: float | None = None) -> None:
    """Joins the job's ranks: torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), mpirun's (OMPI_COMM_WORLD_*), srun's (SLURM_PROCID, SLURM_STEP_NUM_TASKS,
    SLURM_LOCALID), a PMI launcher's (PMI_RANK, PMI_SIZE, with MASTER_ADDR and MASTER_PORT), or
    none (one process); an environment that says there are several ranks but gives no way to join
    them raises ValueError rather than run as one process alone. backend "auto" takes NCCL
    where CUDA is available (and selects cuda:LOCAL_RANK), else MPI, or under torchrun without
    mpirun torch's gloo ("gloo": collectives through a gloo group of torch.distributed's, made
    beside the default group, which is made here from torchrun's variables where the script made
    none; no MPI needed, slower than MPI's, no HSDP mesh). Works beside a process group
    the script made with torch.distributed.init_process_group (fsdp.cpp makes its own
    communicator). On GPUs it turns on the caching allocator's expandable segments unless
    PYTORCH_CUDA_ALLOC_CONF is set; on CPU ranks it counts host allocations from here on (for
    allocated_bytes and the planner). A collective that waits longer than timeout_s (default: FSDP_TIMEOUT_S, else
    the library's) raises, naming the rank, the group and the operation. A second call does
    nothing."""
    global _info
    if _info is not None:
        return
    if backend not in ("auto", "mpi", "nccl", "gloo"):
        raise ValueError(f"fsdpcpp.init: backend must be 'auto', 'mpi', 'nccl' or 'gloo', not {backend!r}")
    if backend == "gloo" or (backend == "auto" and _torchrun_on_cpu()):
        from ._dtensor import gloo_world
        rank_, world, device_, backend_name = _C.init_from_process_group(gloo_world(), timeout_s)
        # The communicator lets its process group go before torch.distributed's own end at exit
        # (atexit runs this first) and long before the interpreter's.
        atexit.register(_C.shutdown)
    else:
        _move_off_the_process_groups_port()
        rank_, world, device_, backend_name = _C.init(backend, timeout_s)
    _info = (rank_, world, torch.device(device_), backend_name)
    _end_the_job_on_an_uncaught_exception()
    if _info[2].type == "cpu":
        _C.count_host_allocations()  # what the planner's profile measures on CPU ranks (allocated_bytes)
    if _info[2].type == "cuda":
        torch.cuda.set_device(_info[2])
        if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            # As fsdp-train: the caching allocator grows one mapping instead of keeping fixed
            # segments, so memory that activations free is reused at any size (reserved stays
            # near allocated). A PYTORCH_CUDA_ALLOC_CONF of the user's, even empty, wins.
            # (torch 2.11 names the setter here; torch.cuda.memory's old name warns.)
            torch._C._accelerator_setAllocatorSettings("expandable_segments:True")


exiting_on_error = False  # an uncaught exception ends this process (its exit handlers skip collectives)


def _end_the_job_on_an_uncaught_exception() -> None:
    """An exception nobody caught ends every rank within seconds, not at the collective timeout:
    once the traceback is out, a rank of several says which rank failed and how, and ends the job
    (MPI_Abort under mpirun, which stops the others; otherwise it exits at once, skipping the exit
    handlers whose collectives would wait for peers, and torchrun or fsdp-run stops the others).
    A peer waiting in a collective for this rank would otherwise wait for its timeout, and this rank
    in MPI_Finalize for the peer. The job ends in an exit handler registered when the exception
    arrives (so it runs before every other one), not in the hook itself: hooks wrapped around this
    one (torch.distributed's prefixes each line with the rank) print after it returns."""
    previous_hook = sys.excepthook

    def note_failure(kind, value, traceback):
        global exiting_on_error
        exiting_on_error = True
        if _info is not None and _info[1] > 1:
            summary = str(value).strip().splitlines()[0] if str(value).strip() else ""
            atexit.register(_end_the_job, f"fsdpcpp: rank {_info[0]} of {_info[1]} ends the job: uncaught "
                            f"{kind.__name__}{': ' + summary[:300] if summary else ''}")
        previous_hook(kind, value, traceback)

    sys.excepthook = note_failure


def _end_the_job(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if _info[3] == "mpi":
        _C.abort_job(message)  # MPI_Abort: mpirun stops every rank
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def _torchrun_on_cpu() -> bool:
    """Ranks torchrun started (its variables, not mpirun's) on a machine without CUDA."""
    return "RANK" in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ and not torch.cuda.is_available()


def _move_off_the_process_groups_port():
    # A script that made its process group first (FSDP2 scripts do) launched without torchrun's
    # agent store: its rank 0 serves MASTER_PORT already. Rank 0 picks a free port for fsdp.cpp's
    # store and the process group tells the others.
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or "MASTER_ADDR" not in os.environ:
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return  # torchrun: every rank is a client of the agent's store, which takes fsdp.cpp's keys too
    port = torch.zeros(1, dtype=torch.long)
    if dist.get_rank() == 0:
        import socket
        with socket.socket() as s:
            s.bind(("", 0))
            port[0] = s.getsockname()[1]
    backend = dist.get_backend()
    on = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) and torch.cuda.is_available() else "cpu"
    port = port.to(on)
    dist.broadcast(port, 0)
    os.environ["MASTER_PORT"] = str(int(port.item()))


def _ensure_init():
    if _info is None:
        init()


def is_initialized() -> bool:
    return _info is not None


def rank() -> int:
    _ensure_init()
    return _info[0]


def world_size() -> int:
    _ensure_init()
    return _info[1]


def device() -> torch.device:
    """The device this rank computes on (where the model must be before fully_shard)."""
    _ensure_init()
    return _info[2]


def shutdown() -> None:
    """Forgets the communicator (collectives end with it)."""
    global _info
    _C.shutdown()
    _info = None


def _fields(struct) -> dict:
    """A bound C++ struct's fields (RuntimeOptions, RuntimeStats) by name."""
    return {name: getattr(struct, name) for name in dir(struct) if not name.startswith("_")}


def _updated(options, changes: dict, caller: str):
    """A copy of RuntimeOptions `options` with `changes` (names as runtime_options()'s keys)."""
    unknown = sorted(set(changes) - set(_fields(options)))
    if unknown:
        raise ValueError(f"{caller}: unknown runtime options {unknown}; known: {sorted(_fields(options))}")
    updated = _C.RuntimeOptions(options)
    for name, value in changes.items():
        setattr(updated, name, value)
    return updated


def runtime_options() -> dict:
    """The process-wide default scheduling options by name: the fields of the C++ RuntimeOptions
    (help(fsdpcpp._C.RuntimeOptions) says what each means; docs/guide.md). A root may have its own:
    FSDPModule.set_runtime_options."""
    return _fields(_C.runtime_options())


def set_runtime_options(**options) -> None:
    """Changes the process-wide defaults named (see runtime_options), for roots without their own."""
    _C.set_runtime_options(_updated(_C.runtime_options(), options, "fsdpcpp.set_runtime_options"))


def runtime_stats() -> dict:
    """What the runtime counted since the process started: all_gathers, reduce_scatters,
    prefetches, allgather_waits, reduce_scatter_waits, host_step_waits, order_departures."""
    return _fields(_C.runtime_stats())


def all_reduce(tensor, op: str = "sum") -> None:
    """Sums (op="sum") or averages (op="avg") `tensor` over the ranks, in place, on fsdp.cpp's
    communicator (for a global loss to log: fsdpcpp.init makes no torch.distributed process
    group). Collective: every rank calls it with a tensor of the same shape on its device."""
    if op not in ("sum", "avg"):
        raise ValueError(f"fsdpcpp.all_reduce: op must be 'sum' or 'avg', not {op!r}")
    _ensure_init()
    _C.all_reduce(tensor, op == "avg")


def allocated_bytes() -> dict:
    """This rank's allocated bytes as the planner counts them, {"now", "peak"}: the CUDA caching
    allocator's on a GPU (torch.cuda.memory_allocated and max_memory_allocated), on CPU ranks the
    host allocations made since init()."""
    now, peak = _C.allocated_bytes(str(device()))
    return {"now": now, "peak": peak}


def reset_peak_allocated() -> None:
    """Restarts allocated_bytes()'s peak at what is allocated now."""
    _C.reset_peak_allocated(str(device()))


def start_trace() -> None:
    """Records a Chrome trace (Perfetto) of this rank's compute and collectives until write_trace."""
    _ensure_init()
    _C.start_trace()


def write_trace(path: str) -> None:
    """Waits for the device, writes the trace started by start_trace to `path`, stops recording."""
    _C.write_trace(os.fspath(path))
