// The `tessera._tessera` extension module: the C++ half of the Python bindings. The Python
// package (python/tessera/) builds on it; see docs/PYTHON.md.
#include <pybind11/pybind11.h>

#include "py_checkpoint.h"
#include "py_comm.h"
#include "py_manager.h"
#include "py_state.h"
#include "py_status.h"

PYBIND11_MODULE(_tessera, m) {
  m.doc() = "tessera: distributed checkpoints of sharded tensors (C++ core)";
  tessera::python::RegisterStatus(m);
  tessera::python::RegisterState(m);
  tessera::python::RegisterComm(m);
  tessera::python::RegisterCommCases(m);
  tessera::python::RegisterCheckpoint(m);
  tessera::python::RegisterManager(m);
}
