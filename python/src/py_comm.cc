#include "py_comm.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "py_status.h"
#include "tessera/local_comm.h"

namespace py = pybind11;

namespace tessera::python {
namespace {

// True once the interpreter is shutting down: a thread must not take the GIL any more.
bool IsFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

py::bytes ToPython(const Bytes& data) {
  return py::bytes(reinterpret_cast<const char*>(data.data()), data.size());
}

// Any bytes-like object (bytes, bytearray, memoryview, a contiguous NumPy uint8 array).
Bytes FromPython(const py::handle& object) {
  if (PyBytes_Check(object.ptr())) {
    const char* data = PyBytes_AS_STRING(object.ptr());
    return Bytes(data, data + PyBytes_GET_SIZE(object.ptr()));
  }
  Py_buffer view;
  if (PyObject_GetBuffer(object.ptr(), &view, PyBUF_CONTIG_RO) != 0) throw py::error_already_set();
  const auto* data = static_cast<const uint8_t*>(view.buf);
  Bytes out(data, data + view.len);
  PyBuffer_Release(&view);
  return out;
}

std::vector<Bytes> ListFromPython(const py::handle& object, size_t expected, const char* op) {
  auto list = py::reinterpret_borrow<py::sequence>(object);
  if (list.size() != expected) {
    throw std::length_error(std::string(op) + " returned " + std::to_string(list.size()) +
                            " buffers for " + std::to_string(expected) + " ranks");
  }
  std::vector<Bytes> out;
  out.reserve(expected);
  for (const py::handle item : list) out.push_back(FromPython(item));
  return out;
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

// A Comm whose collectives are the methods of a Python object: rank and size (attributes),
// barrier(), broadcast(data_or_None, root) -> bytes, gather(data, root) -> list or None,
// all_gather(data) -> list, scatter(list_or_None, root) -> bytes, all_reduce(list_of_int, op)
// -> list, split(color, key) -> another such object; optionally abort(message). Each call
// takes the GIL, whatever the calling thread; a Python exception becomes the status (kAborted
// unless it is a tessera exception with its own code).
class PythonComm final : public Comm {
 public:
  // Requires the GIL.
  explicit PythonComm(py::object impl) : impl_(std::move(impl)) {
    rank_ = impl_.attr("rank").cast<int>();
    size_ = impl_.attr("size").cast<int>();
    if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
      throw py::value_error("python comm: rank " + std::to_string(rank_) + " of size " +
                            std::to_string(size_) + " is not a valid rank");
    }
  }

  ~PythonComm() override {
    if (IsFinalizing()) {
      impl_.release();  // the interpreter is going away: nothing to give back to
      return;
    }
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status Barrier() override {
    return Call("barrier", [&] { impl_.attr("barrier")(); });
  }

  Status Broadcast(Bytes* data, int root) override {
    TESSERA_RETURN_IF_ERROR(CheckRoot("broadcast", root));
    return Call("broadcast", [&] {
      py::object out =
          impl_.attr("broadcast")(rank_ == root ? py::object(ToPython(*data)) : py::none(), root);
      if (rank_ != root) *data = FromPython(out);
    });
  }

  Status Gather(const Bytes& send, std::vector<Bytes>* received, int root) override {
    TESSERA_RETURN_IF_ERROR(CheckRoot("gather", root));
    return Call("gather", [&] {
      py::object out = impl_.attr("gather")(ToPython(send), root);
      if (rank_ == root) *received = ListFromPython(out, size_, "gather");
    });
  }

  Status AllGather(const Bytes& send, std::vector<Bytes>* received) override {
    return Call("all_gather", [&] {
      *received = ListFromPython(impl_.attr("all_gather")(ToPython(send)), size_, "all_gather");
    });
  }

  Status Scatter(const std::vector<Bytes>& send, Bytes* received, int root) override {
    TESSERA_RETURN_IF_ERROR(CheckRoot("scatter", root));
    if (rank_ == root && send.size() != static_cast<size_t>(size_)) {
      return InvalidArgument("scatter: " + std::to_string(send.size()) + " buffers for " +
                             std::to_string(size_) + " ranks");
    }
    return Call("scatter", [&] {
      py::object chunks = py::none();
      if (rank_ == root) {
        py::list list;
        for (const Bytes& b : send) list.append(ToPython(b));
        chunks = std::move(list);
      }
      *received = FromPython(impl_.attr("scatter")(chunks, root));
    });
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    return Call("all_reduce", [&] {
      std::vector<int64_t> in(values.begin(), values.end());
      auto out = impl_.attr("all_reduce")(in, ReduceOpName(op)).cast<std::vector<int64_t>>();
      if (out.size() != values.size()) {
        throw std::length_error("all_reduce returned " + std::to_string(out.size()) +
                                " values for " + std::to_string(values.size()));
      }
      std::copy(out.begin(), out.end(), values.begin());
    });
  }

  Result<std::unique_ptr<Comm>> Split(int color, int key) override {
    std::unique_ptr<Comm> split;
    TESSERA_RETURN_IF_ERROR(Call(
        "split", [&] { split = std::make_unique<PythonComm>(impl_.attr("split")(color, key)); }));
    return split;
  }

  void Abort(const Status& reason) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abort_status_.ok()) return;
      abort_status_ = Aborted("rank " + std::to_string(rank_) + " aborted: " + reason.ToString());
    }
    if (IsFinalizing()) return;
    py::gil_scoped_acquire gil;
    try {
      if (py::hasattr(impl_, "abort")) impl_.attr("abort")(reason.ToString());
    } catch (py::error_already_set&) {
      // Best effort: the communicator is marked failed either way.
    }
  }

 private:
  Status CheckRoot(const char* op, int root) const {
    if (root >= 0 && root < size_) return Status::Ok();
    return InvalidArgument(std::string(op) + ": root " + std::to_string(root) +
                           " is not a rank of a communicator of size " + std::to_string(size_));
  }

  template <typename F>
  Status Call(const char* op, F&& body) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abort_status_.ok()) return abort_status_;
    }
    if (IsFinalizing()) return Aborted(std::string("python comm ") + op + ": exiting");
    py::gil_scoped_acquire gil;
    try {
      body();
      return Status::Ok();
    } catch (py::error_already_set& e) {
      return StatusFromPythonError(e, StatusCode::kAborted, std::string("python comm ") + op);
    } catch (const std::exception& e) {
      return Internal(std::string("python comm ") + op + ": " + e.what());
    }
  }

  py::object impl_;
  int rank_ = 0;
  int size_ = 1;
  std::mutex mu_;
  Status abort_status_;
};

// Chooses which rank's exception run_local raises: the lowest rank whose error is not merely
// the echo of another rank's failure (a collective that gave up: kAborted, kDeadlineExceeded).
int RootCauseRank(const std::vector<py::object>& errors) {
  int first = -1;
  for (int r = 0; r < static_cast<int>(errors.size()); ++r) {
    if (!errors[r]) continue;
    if (first < 0) first = r;
    py::object code = py::getattr(errors[r], "status_code", py::none());
    if (code.is_none()) return r;
    const int c = code.cast<int>();
    if (c != static_cast<int>(StatusCode::kAborted) &&
        c != static_cast<int>(StatusCode::kDeadlineExceeded)) {
      return r;
    }
  }
  return first;
}

py::list RunLocal(int num_ranks, const py::function& fn, double timeout_seconds) {
  if (num_ranks < 1) throw py::value_error("run_local: num_ranks must be at least 1");
  if (!(timeout_seconds > 0)) throw py::value_error("run_local: timeout must be positive");
  LocalCommOptions options;
  options.timeout = std::chrono::milliseconds(std::llround(timeout_seconds * 1000));
  std::vector<py::object> results(num_ranks);
  std::vector<py::object> errors(num_ranks);
  std::vector<Status> statuses;
  {
    py::gil_scoped_release release;
    statuses = RunLocalRanks(
        num_ranks,
        [&](Comm& comm) -> Status {
          py::gil_scoped_acquire gil;
          const int rank = comm.rank();
          Status status;
          py::object handle = py::cast(std::make_unique<CommHandle>(&comm));
          try {
            results[rank] = fn(handle);
          } catch (py::error_already_set& e) {
            errors[rank] = e.value();
            status = StatusFromPythonError(e, StatusCode::kAborted, "");
          } catch (const std::exception& e) {
            status = Internal(e.what());
          }
          handle.cast<CommHandle&>().Invalidate();
          return status;
        },
        options);
  }
  const int culprit = RootCauseRank(errors);
  if (culprit >= 0) {
    py::object error = errors[culprit];
    error.attr("add_note")("(raised on rank " + std::to_string(culprit) + " of " +
                           std::to_string(num_ranks) + " in tessera.run_local)");
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    throw py::error_already_set();
  }
  ThrowIfError(FirstError(statuses));
  py::list out;
  for (py::object& result : results) out.append(result ? result : py::none());
  return out;
}

}  // namespace

CommHandle::~CommHandle() {
  if (!owned_) return;
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    owned_.reset();
  } else {
    owned_.reset();
  }
}

Comm& CommHandle::get() const {
  if (!comm_) {
    throw std::runtime_error(
        "this tessera.Comm belonged to a tessera.run_local rank function that has returned");
  }
  return *comm_;
}

void RegisterComm(py::module_& m) {
  py::class_<CommHandle>(m, "Comm",
                         "A communicator: the ranks that save or load a checkpoint together.\n"
                         "Made by single_rank_comm(), run_local(), torch_dist_comm(), "
                         "mpi_comm() or python_comm().")
      .def_property_readonly(
          "rank", [](const CommHandle& c) { return c.get().rank(); }, "This process's rank.")
      .def_property_readonly(
          "size", [](const CommHandle& c) { return c.get().size(); }, "The number of ranks.")
      .def(
          "barrier",
          [](const CommHandle& c) {
            Comm& comm = c.get();
            py::gil_scoped_release release;
            ThrowIfError(comm.Barrier());
          },
          "COLLECTIVE. Returns when every rank has entered.")
      .def(
          "broadcast",
          [](const CommHandle& c, std::optional<py::bytes> data, int root) {
            Comm& comm = c.get();
            Bytes bytes;
            if (comm.rank() == root) {
              if (!data) throw py::value_error("broadcast: the root must pass data");
              bytes = FromPython(*data);
            }
            {
              py::gil_scoped_release release;
              ThrowIfError(comm.Broadcast(&bytes, root));
            }
            return ToPython(bytes);
          },
          py::arg("data"), py::arg("root") = 0,
          "COLLECTIVE. Returns root's bytes on every rank (`data` is ignored elsewhere).")
      .def(
          "all_gather",
          [](const CommHandle& c, py::bytes data) {
            Comm& comm = c.get();
            Bytes bytes = FromPython(data);
            std::vector<Bytes> all;
            {
              py::gil_scoped_release release;
              ThrowIfError(comm.AllGather(bytes, &all));
            }
            py::list out;
            for (const Bytes& b : all) out.append(ToPython(b));
            return out;
          },
          py::arg("data"), "COLLECTIVE. Every rank's bytes, indexed by rank.")
      .def(
          "gather",
          [](const CommHandle& c, py::bytes data, int root) -> py::object {
            Comm& comm = c.get();
            Bytes bytes = FromPython(data);
            std::vector<Bytes> all;
            {
              py::gil_scoped_release release;
              ThrowIfError(comm.Gather(bytes, &all, root));
            }
            if (comm.rank() != root) return py::none();
            py::list out;
            for (const Bytes& b : all) out.append(ToPython(b));
            return out;
          },
          py::arg("data"), py::arg("root") = 0,
          "COLLECTIVE. On `root`, every rank's bytes indexed by rank; None elsewhere.")
      .def(
          "all_reduce",
          [](const CommHandle& c, std::vector<int64_t> values, const std::string& op) {
            Comm& comm = c.get();
            ReduceOp reduce_op;
            if (op == "sum") {
              reduce_op = ReduceOp::kSum;
            } else if (op == "min") {
              reduce_op = ReduceOp::kMin;
            } else if (op == "max") {
              reduce_op = ReduceOp::kMax;
            } else {
              throw py::value_error("all_reduce: op must be 'sum', 'min' or 'max', not '" + op +
                                    "'");
            }
            {
              py::gil_scoped_release release;
              ThrowIfError(comm.AllReduce(values, reduce_op));
            }
            return values;
          },
          py::arg("values"), py::arg("op") = "sum",
          "COLLECTIVE. Element-wise sum, min or max of int64 values over the ranks.")
      .def("__repr__", [](const CommHandle& c) {
        try {
          const Comm& comm = c.get();
          return "<tessera.Comm rank " + std::to_string(comm.rank()) + " of " +
                 std::to_string(comm.size()) + ">";
        } catch (const std::exception&) {
          return std::string("<tessera.Comm (finished run_local rank)>");
        }
      });

  m.def(
      "_agree_on_status",
      [](const CommHandle& c, int code, const std::string& message) {
        Comm& comm = c.get();
        if (code < 0 || code > static_cast<int>(StatusCode::kDeadlineExceeded)) {
          throw py::value_error("not a status code: " + std::to_string(code));
        }
        const Status local(static_cast<StatusCode>(code), message);
        Status agreed;
        {
          py::gil_scoped_release release;
          agreed = AgreeOnStatus(comm, local);
        }
        ThrowIfError(agreed);
      },
      py::arg("comm"), py::arg("code"), py::arg("message"),
      "COLLECTIVE. Every rank contributes its status (code 0: OK); raises on every rank the "
      "first failing rank's error, if any.");
  m.def(
      "single_rank_comm", [] { return std::make_unique<CommHandle>(NewSingleRankComm()); },
      "A communicator of one rank.");
  m.def(
      "python_comm",
      [](py::object impl) {
        return std::make_unique<CommHandle>(std::make_shared<PythonComm>(std::move(impl)));
      },
      py::arg("impl"),
      "A communicator whose collectives call methods of `impl` (see docs/PYTHON.md).");
  m.def("run_local", &RunLocal, py::arg("num_ranks"), py::arg("fn"), py::arg("timeout") = 600.0,
        "Runs fn(comm) for num_ranks ranks on as many threads, over an in-process communicator,\n"
        "and returns the results indexed by rank. A collective waits at most `timeout` seconds\n"
        "for its peers. If any rank raises, the exception of the first failing rank is raised\n"
        "(ranks whose collectives only gave up because of it are passed over).");
  // The MPI Comm lives in its own extension module (tessera._tessera_mpi, python/src/
  // mpi_module.cc), so that importing tessera never needs libmpi. It hands its Comm over in a
  // capsule: one owned std::shared_ptr<Comm>, taken here exactly once.
  m.def(
      "_comm_from_capsule",
      [](py::capsule capsule) {
        if (std::string(capsule.name() ? capsule.name() : "") != kSharedCommCapsule) {
          throw std::invalid_argument("not a tessera Comm capsule");
        }
        auto* shared = capsule.get_pointer<std::shared_ptr<Comm>>();
        if (shared == nullptr || *shared == nullptr) {
          throw std::invalid_argument("this tessera Comm capsule was already used");
        }
        return std::make_unique<CommHandle>(std::exchange(*shared, nullptr));
      },
      py::arg("capsule"), "Takes the Comm out of a capsule made by tessera._tessera_mpi.");
}

}  // namespace tessera::python
