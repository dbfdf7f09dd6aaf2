// A test hook: the Comm conformance cases (include/tessera/testing/comm_cases.h) run from
// Python on any tessera.Comm, so the torch.distributed Comm (python_comm over
// tessera/_torch_comm.py) runs the same list as the single-rank Comm, LocalComm and MPI
// (python/tests/test_comm_suite.py). Not part of the public API.
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "py_comm.h"
#include "tessera/testing/comm_cases.h"

namespace py = pybind11;

namespace tessera::python {

void RegisterCommCases(py::module_& m) {
  m.def(
      "_comm_cases",
      [] {
        std::vector<std::tuple<std::string, int>> out;
        for (const testing::CommCase& c : testing::CommSuiteCases()) {
          out.emplace_back(c.name, c.min_ranks);
        }
        return out;
      },
      "Every case of the Comm conformance suite, in order: (name, fewest ranks it needs).");
  m.def(
      "_run_comm_case",
      [](const CommHandle& handle, const std::string& name, bool agreed_argument_errors) {
        Comm& comm = handle.get();
        const testing::CommCase* found = nullptr;
        for (const testing::CommCase& c : testing::CommSuiteCases()) {
          if (name == c.name) found = &c;
        }
        if (found == nullptr) throw py::value_error("no Comm suite case named '" + name + "'");
        if (comm.size() < found->min_ranks) {
          throw py::value_error("Comm suite case " + name + " needs " +
                                std::to_string(found->min_ranks) + " ranks or more, not " +
                                std::to_string(comm.size()));
        }
        std::vector<std::string> failures;
        {
          py::gil_scoped_release release;
          failures = testing::RunCommCase(
              *found, comm, comm.size(),
              testing::CommSuiteTraits{.agreed_argument_errors = agreed_argument_errors});
        }
        if (failures.empty()) return;
        std::string text = name + " failed on rank " + std::to_string(comm.rank()) + ":";
        for (const std::string& f : failures) text += "\n  " + f;
        PyErr_SetString(PyExc_AssertionError, text.c_str());
        throw py::error_already_set();
      },
      py::arg("comm"), py::arg("name"), py::kw_only(), py::arg("agreed_argument_errors"),
      "COLLECTIVE. Runs the Comm suite case `name` on this rank's `comm` (every rank runs it at "
      "the same time, on the same fresh communicator); raises AssertionError with the failures "
      "this rank found. `agreed_argument_errors`: the Comm's trait (comm_cases.h).");
}

}  // namespace tessera::python
