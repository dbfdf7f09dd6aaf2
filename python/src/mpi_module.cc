// The `tessera._tessera_mpi` extension module: tessera's MPI Comm (include/tessera/mpi_comm.h)
// for Python, over an mpi4py communicator. It is a module of its own so that `import tessera`
// never loads libmpi: only tessera.mpi_comm() imports it. The Comm crosses to tessera._tessera
// in a capsule (py_comm.h, kSharedCommCapsule).
#include <mpi.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <type_traits>

#include "py_comm.h"
#include "tessera/mpi_comm.h"

namespace py = pybind11;

namespace {

// An MPI_Comm from the integer mpi4py's MPI._handleof gives: a pointer (Open MPI) or an int
// (MPICH).
template <typename Handle = MPI_Comm>
Handle MpiCommFromHandle(uintptr_t handle) {
  if constexpr (std::is_pointer_v<Handle>) {
    return reinterpret_cast<Handle>(handle);
  } else {
    return static_cast<Handle>(handle);
  }
}

// Raises the tessera exception for `status` (tessera._tessera maps codes to classes; the call
// raises, which pybind11 turns into error_already_set).
[[noreturn]] void RaiseStatus(const tessera::Status& status) {
  py::module_::import("tessera._tessera")
      .attr("_raise_status")(static_cast<int>(status.code()), py::bytes(status.message()));
  throw std::logic_error("unreachable: _raise_status returned");
}

}  // namespace

PYBIND11_MODULE(_tessera_mpi, m) {
  m.doc() = "tessera's MPI Comm (loaded only by tessera.mpi_comm())";
  m.def(
      "new_mpi_comm_capsule",
      [](uintptr_t handle) {
        tessera::Result<std::unique_ptr<tessera::Comm>> comm = [&] {
          py::gil_scoped_release release;
          return tessera::NewMpiComm(MpiCommFromHandle(handle));
        }();
        if (!comm.ok()) RaiseStatus(comm.status());
        auto* shared = new std::shared_ptr<tessera::Comm>(std::move(comm).value());
        return py::capsule(shared, tessera::python::kSharedCommCapsule, [](PyObject* o) {
          delete static_cast<std::shared_ptr<tessera::Comm>*>(
              PyCapsule_GetPointer(o, tessera::python::kSharedCommCapsule));
        });
      },
      py::arg("handle"),
      "COLLECTIVE. A capsule holding a Comm over a duplicate of the MPI communicator `handle`.");
}
