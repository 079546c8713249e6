// fsdpcpp._C: the Python package's binding of the library's module-agnostic core (fsdp/unit.h)
// and of the rest of its public API that a Python front end needs. Python finds the units in its
// module tree and registers the hooks (fsdpcpp/_fully_shard.py); everything else runs here, in C++.
#include <torch/csrc/utils/pybind.h>

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

namespace py = pybind11;

namespace {

// A sharded unit as Python holds it: the unit and the token its registration lives as long as
// (the module holds this object, so the unit is forgotten with the module).
struct PyUnit {
  std::shared_ptr<fsdp::ModuleState> unit;
  std::shared_ptr<const void> lifetime;
};

fsdp::RuntimeOptions runtime_options_from(const py::dict& d) {
  fsdp::RuntimeOptions o = fsdp::runtime_options();
  for (const auto& [key, value] : d) {
    const auto k = key.cast<std::string>();
    if (k == "prefetch_depth") o.prefetch_depth = value.cast<int>();
    else if (k == "max_inflight_allgathers") o.max_inflight_allgathers = value.cast<int>();
    else if (k == "max_inflight_reduce_scatters") o.max_inflight_reduce_scatters = value.cast<int>();
    else if (k == "bucket_mb") o.bucket_mb = value.cast<double>();
    else if (k == "reduce_bucket_max_wait") o.reduce_bucket_max_wait = value.cast<int>();
    else if (k == "max_pending_host_steps") o.max_pending_host_steps = value.cast<int>();
    else throw std::invalid_argument("fsdpcpp: unknown runtime option '" + k + "'");
  }
  return o;
}

py::dict dict_of(const fsdp::RuntimeOptions& o) {
  py::dict d;
  d["prefetch_depth"] = o.prefetch_depth;
  d["max_inflight_allgathers"] = o.max_inflight_allgathers;
  d["max_inflight_reduce_scatters"] = o.max_inflight_reduce_scatters;
  d["bucket_mb"] = o.bucket_mb;
  d["reduce_bucket_max_wait"] = o.reduce_bucket_max_wait;
  d["max_pending_host_steps"] = o.max_pending_host_steps;
  return d;
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
        fsdp::InitOptions options;
        options.backend = backend == "mpi" ? fsdp::Backend::Mpi
                          : backend == "nccl" ? fsdp::Backend::Nccl
                                              : fsdp::Backend::Auto;
        if (timeout_s) options.timeout = std::chrono::milliseconds(static_cast<long long>(*timeout_s * 1000));
        auto comm = fsdp::init(options);
        return py::make_tuple(comm->rank(), comm->world_size(), comm->device().str(), std::string(comm->backend()));
      },
      py::arg("backend") = "auto", py::arg("timeout_s") = py::none());
  m.def("initialized", [] {
    try {
      fsdp::default_communicator();
      return true;
    } catch (const std::exception&) {
      return false;
    }
  });
  m.def("shutdown", &fsdp::shutdown);
  m.def("all_reduce_sum", [](at::Tensor t) {
    fsdp::default_communicator()->all_reduce(t, fsdp::ReduceOp::Sum);
    return t;
  });

  py::class_<PyUnit>(m, "Unit")
      .def_property_readonly("name", [](const PyUnit& u) { return fsdp::unit_name(*u.unit); })
      .def("pre_forward", [](PyUnit& u) { fsdp::unit_pre_forward(*u.unit); })
      .def("post_forward", [](PyUnit& u, const std::vector<at::Tensor>& outputs) {
        fsdp::unit_post_forward(*u.unit, outputs);
      })
      .def("abort_forward", [](PyUnit& u) { fsdp::unit_abort_forward(*u.unit); })
      .def("set_requires_gradient_sync", [](PyUnit& u, bool sync) { fsdp::set_requires_gradient_sync(*u.unit, sync); })
      .def("set_reshard_after_forward", [](PyUnit& u, bool r) { fsdp::set_reshard_after_forward(*u.unit, r); })
      .def("reshard", [](PyUnit& u) { fsdp::reshard(*u.unit); })
      .def("set_runtime_options", [](PyUnit& u, const py::dict& d) {
        fsdp::set_runtime_options(*u.unit, runtime_options_from(d));
      });

  m.def(
      "shard_unit",
      [](const std::string& name, const fsdp::NamedTensors& params, const std::vector<PyUnit*>& inner,
         std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype,
         bool reshard_after_forward, bool cpu_offload) {
        auto lifetime = std::make_shared<int>(0);
        fsdp::UnitSpec spec{name, params, {}, lifetime.get(), lifetime, "fsdpcpp.fully_shard"};
        for (const PyUnit* u : inner) spec.inner.push_back(u->unit);
        fsdp::ShardOptions options;
        options.reshard_after_forward = reshard_after_forward;
        options.cpu_offload = cpu_offload;
        options.mixed_precision.param_dtype = param_dtype;
        options.mixed_precision.reduce_dtype = reduce_dtype;
        return PyUnit{fsdp::shard_unit(std::move(spec), options), lifetime};
      },
      py::arg("name"), py::arg("params"), py::arg("inner"), py::arg("param_dtype"), py::arg("reduce_dtype"),
      py::arg("reshard_after_forward"), py::arg("cpu_offload"));
  m.def("is_sharded_parameter", [](const at::Tensor& p) { return fsdp::unit_of_parameter(p) != nullptr; });
  m.def("unit_name_of_parameter", [](const at::Tensor& p) -> std::optional<std::string> {
    auto unit = fsdp::unit_of_parameter(p);
    if (!unit) return std::nullopt;
    return fsdp::unit_name(*unit);
  });
  m.def("full_parameter", [](const at::Tensor& p) { return fsdp::full_parameter(p); });
  m.def("shard_rows", [](const at::Tensor& p) {
    const auto rows = fsdp::shard_rows_of(p);
    return py::make_tuple(rows.first_row, rows.rows, rows.full_shape);
  });
  m.def("clip_grad_norm_", [](const fsdp::NamedTensors& params, double max_norm) {
    return fsdp::clip_grad_norm_(params, max_norm);
  });

  m.def("set_runtime_options", [](const py::dict& d) { fsdp::set_runtime_options(runtime_options_from(d)); });
  m.def("runtime_options", [] { return dict_of(fsdp::runtime_options()); });
  m.def("runtime_stats", [] {
    const auto s = fsdp::runtime_stats();
    py::dict d;
    d["allgather_waits"] = s.allgather_waits;
    d["reduce_scatter_waits"] = s.reduce_scatter_waits;
    d["host_step_waits"] = s.host_step_waits;
    d["prefetches"] = s.prefetches;
    d["order_departures"] = s.order_departures;
    d["all_gathers"] = s.all_gathers;
    d["reduce_scatters"] = s.reduce_scatters;
    return d;
  });
  m.def("start_trace", &fsdp::start_trace);
  m.def("write_trace", &fsdp::write_trace);

  m.def("save_checkpoint", [](const std::string& dir, const ShardedEntries& sharded,
                              const fsdp::NamedTensors& replicated, const std::map<std::string, std::string>& extra) {
    py::gil_scoped_release no_gil;
    fsdp::save_checkpoint(dir, checkpoint_state(sharded, replicated, extra));
  });
  m.def("load_checkpoint", [](const std::string& dir, const ShardedEntries& sharded,
                              const fsdp::NamedTensors& replicated) {
    auto state = checkpoint_state(sharded, replicated, {});
    {
      py::gil_scoped_release no_gil;
      fsdp::load_checkpoint(dir, state);
    }
    return state.extra;
  });
  m.def("newest_checkpoint", &fsdp::newest_checkpoint);
  m.def("checkpoint_name", &fsdp::checkpoint_name);
}
