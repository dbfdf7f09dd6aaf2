// tessera.Comm: a tessera::Comm held by Python.
//
//   - single_rank_comm(): one process;
//   - run_local(n, fn): n ranks as n Python threads over LocalComm (the GIL is released in
//     every C++ call, so the ranks really run in parallel inside tessera);
//   - python_comm(impl): a Comm whose collectives call the Python object `impl` (how the
//     torch.distributed comm of tessera/_torch_comm.py is made), from any thread, taking the
//     GIL for the call;
//   - mpi_comm(handle): MPI, through the separate module tessera._tessera_mpi (mpi_module.cc).
#ifndef TESSERA_PYTHON_PY_COMM_H_
#define TESSERA_PYTHON_PY_COMM_H_

#include <pybind11/pybind11.h>

#include <memory>

#include "tessera/comm.h"

namespace tessera::python {

// What a Python `tessera.Comm` object holds: an owned Comm, or one borrowed for the duration of
// a run_local rank function (afterwards, using it raises).
class CommHandle {
 public:
  explicit CommHandle(std::shared_ptr<Comm> owned)
      : owned_(std::move(owned)), comm_(owned_.get()) {}
  explicit CommHandle(Comm* borrowed) : comm_(borrowed) {}
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  // Releases the GIL while the Comm is destroyed: destroying a Comm waits for the
  // asynchronous saves in flight on it, whose background thread may need the GIL.
  ~CommHandle();

  // Throws when the borrowed Comm is gone.
  Comm& get() const;
  void Invalidate() { comm_ = nullptr; }

 private:
  std::shared_ptr<Comm> owned_;
  Comm* comm_ = nullptr;
};

// The name of the PyCapsule that carries one owned std::shared_ptr<Comm> from another
// extension module (tessera._tessera_mpi) to tessera._tessera (`_comm_from_capsule`).
inline constexpr const char* kSharedCommCapsule = "tessera.shared_comm";

void RegisterComm(pybind11::module_& m);

// The test hook that runs the Comm conformance cases on a tessera.Comm (py_comm_cases.cc).
void RegisterCommCases(pybind11::module_& m);

}  // namespace tessera::python

#endif  // TESSERA_PYTHON_PY_COMM_H_
