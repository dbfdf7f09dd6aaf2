// tessera.CheckpointManager's C++ half (_CheckpointManager) and its reports.
#ifndef TESSERA_PYTHON_PY_MANAGER_H_
#define TESSERA_PYTHON_PY_MANAGER_H_

#include <pybind11/pybind11.h>

namespace tessera::python {

void RegisterManager(pybind11::module_& m);

}  // namespace tessera::python

#endif  // TESSERA_PYTHON_PY_MANAGER_H_
