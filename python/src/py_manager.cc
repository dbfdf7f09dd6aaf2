// tessera._tessera._CheckpointManager: the C++ CheckpointManager for tessera/_manager.py, with
// its reports. Every call into the manager releases the GIL; the callables it is given (warn,
// the loader of a restore, map_per_rank) take it back.
#include "py_manager.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "py_async.h"
#include "py_comm.h"
#include "py_state.h"
#include "py_status.h"
#include "tessera/checkpoint_manager.h"

namespace py = pybind11;

namespace tessera::python {
namespace {

// Whether the interpreter is shutting down (then no Python object may be touched).
bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// Failures of background saves that no call returned before their manager was destroyed: the
// exit hook of tessera/_manager.py reports them and makes the exit status non-zero.
std::mutex unseen_mu;
std::vector<Status> unseen_failures;

// A Python callable kept by C++ code that may run on a thread without the GIL, and may be the
// last owner there: calls and the release take the GIL.
struct PyCallable {
  struct Held {
    py::object fn;
    ~Held() {
      if (Finalizing()) {
        fn.release();  // the interpreter is gone: leak the reference rather than touch it
        return;
      }
      py::gil_scoped_acquire gil;
      fn = py::object();
    }
  };
  std::shared_ptr<Held> held;
  explicit PyCallable(py::object fn) : held(std::make_shared<Held>()) { held->fn = std::move(fn); }
};

// The manager and what it needs from Python. Destroyed without the GIL: the destructor waits
// for the save in flight, whose retention may warn (which takes the GIL).
class PyManager {
 public:
  // Opens the manager (CheckpointManager::Open): a root that cannot be opened or step names
  // that are not valid raise here, naming what is wrong.
  PyManager(std::string root, CheckpointManagerOptions options)
      : manager_(ValueOrThrow(CheckpointManager::Open(std::move(root), std::move(options)))) {}
  ~PyManager() {
    py::gil_scoped_release release;
    manager_.reset();
  }
  CheckpointManager& get() { return *manager_; }

 private:
  std::unique_ptr<CheckpointManager> manager_;
};

template <typename F>
auto NoGil(F&& call) {
  auto result = [&] {
    py::gil_scoped_release release;
    return call();
  }();
  return ValueOrThrow(std::move(result));
}

void NoGilStatus(const std::function<Status()>& call) {
  Status status;
  {
    py::gil_scoped_release release;
    status = call();
  }
  ThrowIfError(status);
}

std::unique_ptr<PyManager> MakeManager(const std::string& root, const AsyncSaveOptions& save,
                                       bool async, const std::string& when_busy, int keep_last,
                                       int64_t keep_every, bool write_tracker,
                                       const std::string& layout, const std::string& step_naming,
                                       py::object warn) {
  CheckpointManagerOptions options;
  options.step_naming = ValueOrThrow(ParseStepNaming(step_naming));
  options.save = save;
  options.storage = save.save.storage;
  options.async = async;
  options.when_saving = when_busy == "skip" ? WhenSaving::kSkip : WhenSaving::kWait;
  options.retention = {.keep_last = keep_last, .keep_every = keep_every};
  options.write_tracker = write_tracker;
  options.layout = layout;
  if (!warn.is_none()) {
    PyCallable fn(std::move(warn));
    options.warn = [fn](const std::string& message) {
      if (Finalizing()) {
        std::fprintf(stderr, "tessera: warning: %s\n", message.c_str());
        return;
      }
      py::gil_scoped_acquire gil;
      try {
        fn.held->fn(TextToStr(message));
      } catch (py::error_already_set& e) {
        // A warnings filter that turns warnings into errors: the message is not lost.
        std::fprintf(stderr, "tessera: warning: %s\n", message.c_str());
      }
    };
  }
  options.on_unseen_failure = [](const Status& status) {
    std::lock_guard<std::mutex> lock(unseen_mu);
    unseen_failures.push_back(status);
  };
  return std::make_unique<PyManager>(root, std::move(options));
}

// The restore's loader: the Python callable loader(step, path, keys) -> list of bytes (the
// loaded per-rank objects, in the order of `keys`). What it raises is kept, so that a Python
// error that ends the restore is raised as it was.
struct PyLoader {
  PyCallable fn;
  std::shared_ptr<std::optional<py::error_already_set>> error;
  std::shared_ptr<Status> error_status;
  std::shared_ptr<bool> called;

  Status operator()(int64_t step, const std::string& path, std::vector<ShardedObject>& per_rank) {
    py::gil_scoped_acquire gil;
    *called = true;
    try {
      py::list keys;
      for (const ShardedObject& object : per_rank) keys.append(TextToStr(object.key));
      py::object values = fn.held->fn(step, path, keys);
      size_t i = 0;
      for (py::handle value : values) {
        if (i >= per_rank.size()) break;
        const std::string_view bytes = value.cast<py::bytes>();
        per_rank[i++].data.assign(bytes.begin(), bytes.end());
      }
      return Status::Ok();
    } catch (py::error_already_set& e) {
      Status status =
          StatusFromPythonError(e, StatusCode::kInternal, "loading step " + std::to_string(step));
      *error = std::move(e);
      *error_status = status;
      return status;
    }
  }
};

PerRankMap MapFromPython(py::object fn,
                         std::shared_ptr<std::optional<py::error_already_set>> error) {
  if (fn.is_none()) return nullptr;
  PyCallable callable(std::move(fn));
  return [callable, error](int rank, int world_size, int saved_world_size) {
    py::gil_scoped_acquire gil;
    try {
      py::object out = callable.held->fn(rank, world_size, saved_world_size);
      if (py::isinstance<py::int_>(out)) return std::vector<int>{out.cast<int>()};
      return out.cast<std::vector<int>>();
    } catch (py::error_already_set& e) {
      *error = std::move(e);
    } catch (py::cast_error&) {
      // Reported below as a rank out of range; the message names what map_per_rank returned.
    }
    return std::vector<int>{-1};
  };
}

void RegisterReports(py::module_& m) {
  py::class_<StepInfo>(m, "StepInfo", "A step directory of a CheckpointManager's root.")
      .def_readonly("step", &StepInfo::step)
      .def_property_readonly("path", [](const StepInfo& s) { return TextToStr(s.path); })
      .def_property_readonly(
          "state", [](const StepInfo& s) { return StepStateName(s.state); },
          "'committed', 'uncommitted' (a save not finished, or running), 'damaged' or "
          "'deleting'")
      .def_property_readonly("problem", [](const StepInfo& s) { return TextToStr(s.problem); })
      .def_readonly("marked", &StepInfo::marked)
      .def("__repr__", [](const StepInfo& s) {
        return "StepInfo(step=" + std::to_string(s.step) + ", state='" + StepStateName(s.state) +
               "'" + (s.marked ? ", marked" : "") + ")";
      });
  py::class_<RetentionDecision>(m, "RetentionDecision", "One step's fate in a prune.")
      .def_readonly("step", &RetentionDecision::step)
      .def_property_readonly("path", [](const RetentionDecision& d) { return TextToStr(d.path); })
      .def_readonly("deleted", &RetentionDecision::deleted)
      .def_property_readonly("reason",
                             [](const RetentionDecision& d) { return TextToStr(d.reason); })
      .def("__repr__", [](const RetentionDecision& d) {
        return "RetentionDecision(step=" + std::to_string(d.step) +
               (d.deleted ? ", deleted" : ", kept") + ": " + d.reason + ")";
      });
  py::class_<PruneReport>(m, "PruneReport", "What a prune deleted (or would delete) and kept.")
      .def_readonly("dry_run", &PruneReport::dry_run)
      .def_readonly("steps", &PruneReport::steps)
      .def_readonly("deleted", &PruneReport::deleted)
      .def("__repr__", [](const PruneReport& r) {
        return "PruneReport(" + std::string(r.dry_run ? "dry run, " : "") + "deleted " +
               std::to_string(r.deleted) + " of " + std::to_string(r.steps.size()) + " steps)";
      });
  py::class_<RestoreReport>(m, "_RestoreReport")
      .def_readonly("step", &RestoreReport::step)
      .def_property_readonly("path", [](const RestoreReport& r) { return TextToStr(r.path); })
      .def_property_readonly(
          "skipped",
          [](const RestoreReport& r) {
            py::list out;
            for (const SkippedStep& k : r.skipped) {
              out.append(py::make_tuple(k.step, StatusToException(k.reason), k.failed_checks));
            }
            return out;
          })
      .def_property_readonly(
          "per_rank",
          [](const RestoreReport& r) {
            py::dict out;
            for (const auto& [name, values] : r.per_rank) {
              py::list list;
              for (const Bytes& v : values) {
                list.append(py::bytes(reinterpret_cast<const char*>(v.data()), v.size()));
              }
              out[TextToStr(name)] = list;
            }
            return out;
          })
      .def_property_readonly("user_metadata", [](const RestoreReport& r) {
        py::dict out;
        for (const auto& [k, v] : r.user_metadata) out[TextToStr(k)] = TextToStr(v);
        return out;
      });
  py::class_<ReadLease>(m, "ReadLease",
                        "A reader's claim on a step directory: no CheckpointManager deletes it "
                        "while the lease is held. A context manager: `with manager.lease(step) "
                        "as path:`.")
      .def_property_readonly("step", &ReadLease::step)
      .def_property_readonly("path", [](const ReadLease& l) { return TextToStr(l.path()); })
      .def_property_readonly("held", &ReadLease::held)
      .def("release", &ReadLease::Release, "Releases the lease (idempotent).")
      .def("__enter__", [](const ReadLease& l) { return TextToStr(l.path()); })
      .def("__exit__", [](ReadLease& l, py::args) {
        l.Release();
        return false;
      });
}

}  // namespace

void RegisterManager(py::module_& m) {
  RegisterReports(m);
  py::class_<PyManager>(m, "_CheckpointManager")
      .def(py::init(&MakeManager), py::arg("root"), py::arg("save"), py::arg("async_save"),
           py::arg("when_busy"), py::arg("keep_last"), py::arg("keep_every"),
           py::arg("write_tracker"), py::arg("layout"), py::arg("step_naming"), py::arg("warn"))
      .def(
          "save",
          [](PyManager& self, int64_t step, py::object state, const CommHandle& comm,
             const std::map<std::string, std::string>& user_metadata,
             const std::map<std::string, py::bytes>& per_rank, bool deferred) {
            StateBuilder& builder = state.cast<StateBuilder&>();
            StepExtras extras;
            extras.user_metadata = user_metadata;
            for (const auto& [name, value] : per_rank) {
              const std::string_view bytes(value);
              extras.per_rank[name] = Bytes(bytes.begin(), bytes.end());
            }
            Comm& c = comm.get();
            ManagedSave saved =
                NoGil([&] { return self.get().Save(step, builder.dict(), c, extras); });
            py::object handle = py::none();
            if (saved.handle) {
              handle = py::cast(std::make_unique<PyAsyncSave>(
                  *saved.handle, deferred ? std::move(state) : py::none()));
            }
            return py::make_tuple(saved.skipped, saved.skip_reason, handle, saved.report);
          },
          py::arg("step"), py::arg("state"), py::arg("comm"), py::arg("user_metadata"),
          py::arg("per_rank"), py::arg("deferred"))
      .def("wait", [](PyManager& self) { NoGilStatus([&] { return self.get().Wait(); }); })
      .def("close", [](PyManager& self) { NoGilStatus([&] { return self.get().Close(); }); })
      .def("latest_step",
           [](PyManager& self) { return NoGil([&] { return self.get().LatestStep(); }); })
      .def("all_steps",
           [](PyManager& self) { return NoGil([&] { return self.get().AllSteps(); }); })
      .def("steps", [](PyManager& self) { return NoGil([&] { return self.get().Steps(); }); })
      .def("step_path",
           [](PyManager& self, int64_t step) { return TextToStr(self.get().StepPath(step)); })
      .def(
          "mark",
          [](PyManager& self, int64_t step, const std::string& note) {
            NoGilStatus([&] { return self.get().Mark(step, note); });
          },
          py::arg("step"), py::arg("note"))
      .def("unmark", [](PyManager& self,
                        int64_t step) { NoGilStatus([&] { return self.get().Unmark(step); }); })
      .def("lease", [](PyManager& self,
                       int64_t step) { return NoGil([&] { return self.get().Lease(step); }); })
      .def(
          "prune",
          [](PyManager& self, int keep_last, int64_t keep_every, bool dry_run) {
            return NoGil([&] {
              return self.get().Prune({.keep_last = keep_last, .keep_every = keep_every}, dry_run);
            });
          },
          py::arg("keep_last"), py::arg("keep_every"), py::arg("dry_run"))
      .def("delete", [](PyManager& self,
                        int64_t step) { NoGilStatus([&] { return self.get().Delete(step); }); })
      .def("last_retention", [](PyManager& self) { return self.get().LastRetention(); })
      .def(
          "restore_with",
          [](PyManager& self, const CommHandle& comm, std::optional<int64_t> step,
             py::object map_per_rank, py::object loader) {
            auto error = std::make_shared<std::optional<py::error_already_set>>();
            auto map_error = std::make_shared<std::optional<py::error_already_set>>();
            auto error_status = std::make_shared<Status>();
            RestoreOptions options;
            options.step = step;
            options.map_per_rank = MapFromPython(std::move(map_per_rank), map_error);
            auto called = std::make_shared<bool>(false);
            PyLoader load{PyCallable(std::move(loader)), error, error_status, called};
            Comm& c = comm.get();
            Result<RestoreReport> report = [&] {
              py::gil_scoped_release release;
              return self.get().RestoreWith(c, options, load);
            }();
            if (*map_error) throw std::move(**map_error);
            // A Python error that ended the restore (not one it fell back from) is raised as is.
            const StatusCode code = error_status->code();
            const bool fell_back = code == StatusCode::kDataLoss;  // the restore went on
            if (!report.ok() && *error && !fell_back && report.status().code() == code) {
              throw std::move(**error);
            }
            // Nothing to restore (a fresh run): kNotFound before any load was tried. A load
            // that failed with kNotFound (keys the checkpoint lacks) is an error.
            if (!report.ok() && report.status().code() == StatusCode::kNotFound && !step &&
                !*called) {
              return py::object(py::none());
            }
            return py::cast(ValueOrThrow(std::move(report)));
          },
          py::arg("comm"), py::arg("step"), py::arg("map_per_rank"), py::arg("loader"),
          "The RestoreReport, or None when step is None and the root holds no committed "
          "checkpoint.");
  m.def(
      "_take_unseen_failures",
      [] {
        std::vector<Status> taken;
        {
          std::lock_guard<std::mutex> lock(unseen_mu);
          taken.swap(unseen_failures);
        }
        py::list out;
        for (const Status& s : taken) out.append(StatusToException(s));
        return out;
      },
      "The failures of background saves whose CheckpointManager was destroyed before any call "
      "returned them (for the exit hook).");
  m.def(
      "_forget_unseen_failures_after_fork",
      [] {
        // In a forked child only: the parent's failures are the parent's to report (at its
        // exit). Made anew, not locked or cleared: a parent thread may have held the lock, or
        // been part way through a push_back, at the fork; the old objects are leaked.
        new (&unseen_mu) std::mutex;
        new (&unseen_failures) std::vector<Status>;
      },
      "For os.register_at_fork(after_in_child=...): a forked child does not report its "
      "parent's unseen failures.");
}

}  // namespace tessera::python
