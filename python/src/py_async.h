// tessera.AsyncSaveHandle (PyAsyncSave): an AsyncSaveHandle held by Python, for
// tessera.async_save and CheckpointManager.save.
#ifndef TESSERA_PYTHON_PY_ASYNC_H_
#define TESSERA_PYTHON_PY_ASYNC_H_

#include <pybind11/pybind11.h>

#include <utility>

#include "py_status.h"
#include "tessera/async_save.h"

namespace tessera::python {

// An AsyncSaveHandle plus, with staging="deferred", the StateBuilder viewing the caller's
// tensors, so that they stay alive (and their buffers exported) until the copy is done. Dropped
// once WaitStaged() is seen to have returned, by wait_staged(), wait() or done(); the destructor
// waits for staging (without the GIL) before dropping it. Remembers whether the caller was shown
// the save's failure (wait(), wait_staged() or exception()), so that the exit hook reports a
// failure nobody saw.
class PyAsyncSave {
 public:
  PyAsyncSave(AsyncSaveHandle handle, pybind11::object views)
      : handle_(std::move(handle)), views_(std::move(views)) {}
  PyAsyncSave(const PyAsyncSave&) = delete;
  PyAsyncSave& operator=(const PyAsyncSave&) = delete;
  ~PyAsyncSave() {
    if (!views_.is_none()) {
      pybind11::gil_scoped_release release;
      handle_.WaitStaged().IgnoreError();  // the save's status keeps it
    }
  }

  void WaitStaged() {
    Status status;
    {
      pybind11::gil_scoped_release release;
      status = handle_.WaitStaged();
    }
    views_ = pybind11::none();
    if (!status.ok()) seen_ = true;
    ThrowIfError(status);
  }
  SaveReport Wait() {
    Status status;
    {
      pybind11::gil_scoped_release release;
      status = handle_.Wait();
    }
    views_ = pybind11::none();
    seen_ = true;
    ThrowIfError(status);
    return *handle_.report();
  }
  bool Done() {
    const bool done = handle_.Done();
    if (done) views_ = pybind11::none();  // done implies staged
    return done;
  }
  const AsyncSaveHandle& handle() const { return handle_; }
  bool seen() const { return seen_; }
  void MarkSeen() { seen_ = true; }

 private:
  AsyncSaveHandle handle_;
  pybind11::object views_;  // None once staged, or with staging="blocking"
  bool seen_ = false;
};

}  // namespace tessera::python

#endif  // TESSERA_PYTHON_PY_ASYNC_H_
