// Save, Load, AsyncSave, ReadMetadata, Verify, their options and reports, and the metadata
// classes, as functions and classes of the extension module.
#ifndef TESSERA_PYTHON_PY_CHECKPOINT_H_
#define TESSERA_PYTHON_PY_CHECKPOINT_H_

#include <pybind11/pybind11.h>

namespace tessera::python {

void RegisterCheckpoint(pybind11::module_& m);

}  // namespace tessera::python

#endif  // TESSERA_PYTHON_PY_CHECKPOINT_H_
