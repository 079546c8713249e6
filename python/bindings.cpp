// fsdpcpp._C: the Python package's binding of the library's module-agnostic core (fsdp/group.h)
// and of the rest of its public API that a Python front end needs. Python finds the groups in its
// module tree and registers the hooks (fsdpcpp/_fully_shard.py); everything else runs here, in C++.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <c10/util/Exception.h>

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "fsdp/memory_stats.h"

namespace py = pybind11;

namespace {

// A sharded group as Python holds it: the group and the token its registration lives as long as
// (the module holds this object, so the group is forgotten with the module).
struct PyGroupState {
  std::shared_ptr<fsdp::GroupState> state;
  std::shared_ptr<const void> lifetime;
};

struct RecomputedForward {
  std::unique_ptr<fsdp::RecomputedForwardScope> scope;
};

// A root's groups as Python lists them (module path, group), for the planner's calls.
using PyNamedGroupStates = std::vector<std::pair<std::string, PyGroupState*>>;
fsdp::PlanningRoot planning_root(const std::string& name, const PyNamedGroupStates& groups) {
  std::vector<std::pair<std::string, fsdp::GroupState*>> listed;
  for (const auto& [path, group] : groups) listed.emplace_back(path, group->state.get());
  return fsdp::PlanningRoot(name, std::move(listed));
}

// The checkpoint's tensors as Python lists them: (name, local, like) sharded, (name, tensor) replicated.
using ShardedEntries = std::vector<std::tuple<std::string, at::Tensor, at::Tensor>>;
fsdp::CheckpointState checkpoint_state(const ShardedEntries& sharded, const fsdp::NamedTensors& replicated,
                                       const std::map<std::string, std::string>& extra) {
  fsdp::CheckpointState state;
  for (const auto& [name, local, like] : sharded) state.add_sharded(name, local, like);
  for (const auto& [name, value] : replicated) state.add_replicated(name, value);
  state.extra = extra;
  return state;
}

// FSDPCPP_CRASH_BACKTRACE=1: a crash in native code prints its C++ frames to stderr (Python's
// faulthandler shows only the Python ones), then ends the process as the signal would.
void print_native_frames(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char header[] = "fsdpcpp: native frames of the crash:\n";
  (void)!write(2, header, sizeof(header) - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

void install_crash_backtrace() {
  const char* on = std::getenv("FSDPCPP_CRASH_BACKTRACE");
  if (!on || std::string(on) != "1") return;
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE}) signal(sig, print_native_frames);
}

// fsdpcpp.init's backend name and timeout as the library's options.
fsdp::InitOptions init_options(const std::string& backend, std::optional<double> timeout_s) {
  fsdp::InitOptions options;
  options.backend = backend == "mpi" ? fsdp::Backend::Mpi : backend == "nccl" ? fsdp::Backend::Nccl : fsdp::Backend::Auto;
  if (timeout_s) options.timeout = std::chrono::milliseconds(static_cast<long long>(*timeout_s * 1000));
  return options;
}

// (rank, world size, device, backend): what fsdpcpp.init keeps of the communicator.
py::tuple described(const std::shared_ptr<fsdp::Communicator>& comm) {
  return py::make_tuple(comm->rank(), comm->world_size(), comm->device().str(), std::string(comm->backend()));
}

// A Python function the runtime calls in backward (from a thread without the GIL). The runtime's
// groups may outlive the interpreter (they go with the process's static runtime at exit): then
// the function is left, not released without an interpreter.
fsdp::StepInBackward python_callback(py::function function) {
  std::shared_ptr<py::function> held(new py::function(std::move(function)), [](py::function* f) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete f;
    } else {
      f->release();
      delete f;
    }
  });
  return [held](const std::vector<at::Tensor>&) {
    py::gil_scoped_acquire gil;
    try {
      (*held)();
    } catch (py::error_already_set& e) {
      throw std::runtime_error(e.what());  // the Python error's text, made while the GIL is held
    }
  };
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  install_crash_backtrace();
  m.doc() = "fsdp.cpp's C++ runtime, bound for the fsdpcpp package";
  // One line for a person: libtorch's errors without their C++ backtrace (FSDP_BACKTRACE=1 keeps it).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, fsdp::error_text(e).c_str());
    }
  });

  m.def("version", [] { return std::string(fsdp::version()); });
  m.def(
      "init",
      [](const std::string& backend, std::optional<double> timeout_s) {
        return described(fsdp::init(init_options(backend, timeout_s)));
      },
      py::arg("backend") = "auto", py::arg("timeout_s") = py::none());
  // A torch.distributed process group (torch's Gloo on CPU ranks) as the world's communicator.
  m.def(
      "init_from_process_group",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::optional<double> timeout_s) {
        return described(fsdp::init_from_process_group(group, init_options("auto", timeout_s)));
      },
      py::arg("group"), py::arg("timeout_s") = py::none());
  m.def("initialized", [] {
    try {
      fsdp::default_communicator();
      return true;
    } catch (const std::exception&) {
      return false;
    }
  });
  m.def("shutdown", &fsdp::shutdown);
  m.def("abort_job", [](const std::string& message) {
    pybind11::gil_scoped_release release;
    fsdp::abort_job(message);
  });
  m.def("all_reduce", [](const at::Tensor& t, bool average) {
    fsdp::default_communicator()->all_reduce(t, average ? fsdp::ReduceOp::Avg : fsdp::ReduceOp::Sum);
  });

  // `with _C.recomputed_forward():` around the first pass of a checkpointed call.
  py::class_<RecomputedForward>(m, "recomputed_forward")
      .def(py::init<>())
      .def("__enter__", [](RecomputedForward& c) { c.scope = std::make_unique<fsdp::RecomputedForwardScope>(); })
      .def("__exit__", [](RecomputedForward& c, py::args) { c.scope.reset(); });
  py::class_<PyGroupState>(m, "GroupState")
      .def_property_readonly("name", [](const PyGroupState& g) { return fsdp::group_name(*g.state); })
      .def("pre_forward", [](PyGroupState& g) { fsdp::group_pre_forward(*g.state); })
      .def("post_forward", [](PyGroupState& g, const std::vector<at::Tensor>& outputs) {
        fsdp::group_post_forward(*g.state, outputs);
      })
      .def("abort_forward", [](PyGroupState& g) { fsdp::group_abort_forward(*g.state); })
      .def("set_requires_gradient_sync", [](PyGroupState& g, bool sync) { fsdp::set_requires_gradient_sync(*g.state, sync); })
      // The front end's post-accumulate-grad hooks, once the group's gradients are reduced in
      // backward; they leave the gradients as they want them (None: off).
      .def("set_hooks_in_backward", [](PyGroupState& g, std::optional<py::function> run) {
        fsdp::set_step_in_backward(*g.state, run ? python_callback(std::move(*run)) : fsdp::StepInBackward(),
                                   /*frees_gradients=*/false);
      })
      .def("set_reshard_after_forward", [](PyGroupState& g, bool r) { fsdp::set_reshard_after_forward(*g.state, r); })
      .def("set_prefetch_depth", [](PyGroupState& g, int depth) { fsdp::set_prefetch_depth(*g.state, depth); })
      .def("reshard", [](PyGroupState& g) { fsdp::reshard(*g.state); })
      .def("unshard", [](PyGroupState& g) { fsdp::unshard(*g.state); })
      .def("wait_for_unshard", [](PyGroupState& g) { fsdp::wait_for_unshard(*g.state); })
      .def_property_readonly("reshard_after_forward", [](const PyGroupState& g) { return fsdp::reshard_after_forward(*g.state); })
      .def_property_readonly("prefetch_depth", [](const PyGroupState& g) { return fsdp::prefetch_depth(*g.state); })
      .def("set_runtime_options", [](PyGroupState& g, const fsdp::RuntimeOptions& o) { fsdp::set_runtime_options(*g.state, o); })
      .def("runtime_options", [](const PyGroupState& g) { return fsdp::runtime_options(*g.state); });

  // The dp communicators of (replicas, shards, tp) ranks (fsdp/mesh.h): the ranks of this rank's
  // replica with its tp index, and those holding its shard.
  py::class_<fsdp::Mesh>(m, "Mesh").def_property_readonly("replicas", &fsdp::Mesh::replicas);
  m.def("make_mesh", [](int replicas, int tp) { return fsdp::make_mesh(replicas, nullptr, tp); }, py::arg("replicas"),
        py::arg("tp") = 1);
  m.def(
      "shard_group",
      [](const std::string& name, const fsdp::NamedTensors& params, const std::vector<PyGroupState*>& inner,
         std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype,
         bool reshard_after_forward, bool cpu_offload, const fsdp::Mesh* mesh) {
        auto lifetime = std::make_shared<int>(0);
        fsdp::GroupSpec spec{name, params, {}, lifetime.get(), lifetime, "fsdpcpp.fully_shard"};
        for (const PyGroupState* g : inner) spec.inner.push_back(g->state);
        fsdp::ShardOptions options;
        if (mesh) {
          options.comm = mesh->shard;
          if (mesh->replicas() > 1) options.replicate = mesh->replicate;
        }
        options.reshard_after_forward = reshard_after_forward;
        options.cpu_offload = cpu_offload;
        options.mixed_precision.param_dtype = param_dtype;
        options.mixed_precision.reduce_dtype = reduce_dtype;
        return PyGroupState{fsdp::shard_group(std::move(spec), options), lifetime};
      },
      py::arg("name"), py::arg("params"), py::arg("inner"), py::arg("param_dtype"), py::arg("reduce_dtype"),
      py::arg("reshard_after_forward"), py::arg("cpu_offload"), py::arg("mesh") = nullptr);
  m.def("is_sharded_parameter", [](const at::Tensor& p) { return fsdp::group_of_parameter(p) != nullptr; });
  m.def("group_name_of_parameter", [](const at::Tensor& p) -> std::optional<std::string> {
    auto state = fsdp::group_of_parameter(p);
    if (!state) return std::nullopt;
    return fsdp::group_name(*state);
  });
  m.def("full_parameter", [](const at::Tensor& p) { return fsdp::full_parameter(p); });
  m.def("deferred_parameter", [](const std::vector<int64_t>& shape, at::ScalarType dtype, const std::string& device) {
    return fsdp::deferred_parameter(shape, at::TensorOptions().dtype(dtype).device(device));
  });
  m.def("shard_rows", [](const at::Tensor& p) {
    const auto rows = fsdp::shard_rows_of(p);
    return py::make_tuple(rows.first_row, rows.rows, rows.full_shape);
  });
  m.def("clip_grad_norm_", [](const fsdp::NamedTensors& params, double max_norm) {
    return fsdp::clip_grad_norm_(params, max_norm);
  });
  // Float8 linears (fsdp/float8.h) for fsdpcpp.float8; std::invalid_argument becomes ValueError.
  m.def("float8_linear", [](const at::Tensor& x, const at::Tensor& weight, const std::string& recipe) {
    return fsdp::float8_linear(x, weight, fsdp::float8_recipe_named(recipe));
  });
  m.def("enable_float8_all_gather", &fsdp::enable_float8_all_gather);
  m.def("float8_all_gather_enabled", &fsdp::float8_all_gather_enabled);
  m.def("check_float8_device", [](const std::string& device) { fsdp::check_float8_device(c10::Device(device)); });

  // The structs bound field by field: Python reads their fields' names from the class.
  py::class_<fsdp::RuntimeOptions> runtime_options(m, "RuntimeOptions");
  runtime_options.def(py::init<>()).def(py::init<const fsdp::RuntimeOptions&>());
  fsdp::for_each_runtime_option([&](const char* name, auto member, const char* meaning) {
    runtime_options.def_readwrite(name, member, meaning);
  });
  py::class_<fsdp::RuntimeStats>(m, "RuntimeStats")
      .def_readonly("allgather_waits", &fsdp::RuntimeStats::allgather_waits)
      .def_readonly("reduce_scatter_waits", &fsdp::RuntimeStats::reduce_scatter_waits)
      .def_readonly("host_step_waits", &fsdp::RuntimeStats::host_step_waits)
      .def_readonly("prefetches", &fsdp::RuntimeStats::prefetches)
      .def_readonly("order_departures", &fsdp::RuntimeStats::order_departures)
      .def_readonly("all_gathers", &fsdp::RuntimeStats::all_gathers)
      .def_readonly("reduce_scatters", &fsdp::RuntimeStats::reduce_scatters);
  m.def("set_runtime_options", [](const fsdp::RuntimeOptions& o) { fsdp::set_runtime_options(o); });
  m.def("runtime_options", [] { return fsdp::runtime_options(); });
  m.def("runtime_stats", &fsdp::runtime_stats);

  // The memory-budget planner (fsdp/planning.h); fsdpcpp/_planner.py drives its measuring steps.
  py::class_<fsdp::plan::Schedule>(m, "Schedule")
      .def_readwrite("recompute", &fsdp::plan::Schedule::recompute)
      .def_readwrite("reshard_after_forward", &fsdp::plan::Schedule::reshard_after_forward)
      .def_readwrite("prefetch_depth", &fsdp::plan::Schedule::prefetch_depth)
      .def_readwrite("runtime", &fsdp::plan::Schedule::runtime);
  py::class_<fsdp::plan::Prediction>(m, "Prediction")
      .def_readonly("step_ms", &fsdp::plan::Prediction::step_ms)
      .def_readonly("peak_bytes", &fsdp::plan::Prediction::peak_bytes)
      .def_readonly("peak_during", &fsdp::plan::Prediction::peak_during);
  py::class_<fsdp::plan::Planned>(m, "Planned")
      .def_readonly("schedule", &fsdp::plan::Planned::schedule)
      .def_readonly("prediction", &fsdp::plan::Planned::prediction);
  py::class_<fsdp::plan::Plan>(m, "Plan")
      .def_readonly("chosen", &fsdp::plan::Plan::chosen)
      .def_readonly("usable_bytes", &fsdp::plan::Plan::usable_bytes);
  py::class_<fsdp::plan::CostModel>(m, "CostModel")
      .def_readonly("profiled_peak_bytes", &fsdp::plan::CostModel::profiled_peak_bytes)
      .def_readonly("profiled_step_ms", &fsdp::plan::CostModel::profiled_step_ms);
  m.def("set_schedule", [](const std::string& root, const PyNamedGroupStates& groups, const fsdp::plan::Schedule& s) {
    fsdp::set_schedule(planning_root(root, groups), s);
  });
  py::class_<fsdp::ProfilingSteps>(m, "ProfilingSteps")
      .def(py::init([](const std::string& root, const PyNamedGroupStates& groups,
                       std::function<void(const fsdp::plan::Schedule&)> apply, int micro_batches,
                       bool reduce_every_micro_batch) {
        return std::make_unique<fsdp::ProfilingSteps>(planning_root(root, groups), std::move(apply), micro_batches,
                                                      reduce_every_micro_batch);
      }))
      .def("before_step", &fsdp::ProfilingSteps::before_step)
      .def("start_recording", &fsdp::ProfilingSteps::start_recording)
      .def("after_step", &fsdp::ProfilingSteps::after_step)
      .def("done", &fsdp::ProfilingSteps::done)
      .def("profile", &fsdp::ProfilingSteps::profile, py::return_value_policy::copy);
  // The plan, or (message, smallest budget in bytes) when none fits: Python raises its
  // fsdpcpp.BudgetTooSmall with both.
  m.def("plan_for_budget", [](const std::string& root, const PyNamedGroupStates& groups, int64_t budget_bytes,
                              const fsdp::plan::CostModel& profile, double margin) -> py::object {
    try {
      return py::cast(fsdp::plan_for_budget(planning_root(root, groups), budget_bytes, profile, margin));
    } catch (const fsdp::plan::BudgetTooSmall& e) {
      return py::make_tuple(std::string(e.what()), e.smallest_budget_bytes);
    }
  });
  m.def("count_host_allocations", &fsdp::count_host_allocations);
  m.def("allocated_bytes", [](const std::string& device) {
    const auto bytes = fsdp::allocated_bytes(c10::Device(device));
    return py::make_tuple(bytes.now, bytes.peak);
  });
  m.def("reset_peak_allocated", [](const std::string& device) { fsdp::reset_peak_allocated(c10::Device(device)); });
  m.def("group_names", [](const std::string& root, const PyNamedGroupStates& groups) {
    std::vector<std::string> names;
    for (const auto& shape : fsdp::group_shapes(planning_root(root, groups))) names.push_back(shape.name);
    return names;
  });
  m.def("describe_schedule", &fsdp::plan::describe);
  m.def("format_bytes", &fsdp::plan::format_bytes);

  m.def("start_trace", &fsdp::start_trace);
  m.def("write_trace", &fsdp::write_trace);

  m.def("save_checkpoint", [](const std::string& dir, const ShardedEntries& sharded,
                              const fsdp::NamedTensors& replicated, const std::map<std::string, std::string>& extra) {
    py::gil_scoped_release no_gil;
    fsdp::save_checkpoint(dir, checkpoint_state(sharded, replicated, extra));
  });
  // (extra, the names left out: the checkpoint's tensors under `leave_out` the state does not hold).
  m.def("load_checkpoint", [](const std::string& dir, const ShardedEntries& sharded,
                              const fsdp::NamedTensors& replicated, const std::string& leave_out) {
    auto state = checkpoint_state(sharded, replicated, {});
    std::vector<std::string> left_out;
    {
      py::gil_scoped_release no_gil;
      left_out = fsdp::load_checkpoint(dir, state, leave_out);
    }
    return py::make_tuple(state.extra, left_out);
  });
  // python -m fsdpcpp.convert: each tensor whole, handed to a Python callable (the GIL held).
  m.def("for_each_checkpoint_tensor", [](const std::string& dir, const py::function& visit) {
    fsdp::for_each_checkpoint_tensor(dir, [&](const std::string& name, const at::Tensor& t) { visit(name, t); });
  });
  m.def("newest_checkpoint", &fsdp::newest_checkpoint);
  m.def("checkpoint_name", &fsdp::checkpoint_name);
  m.attr("BUFFER_PREFIX") = fsdp::kBufferPrefix;
  m.attr("OPTIMIZER_PREFIX") = fsdp::kOptimizerPrefix;
  m.def("is_optimizer_state", &fsdp::is_optimizer_state);
}
