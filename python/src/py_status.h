// Status -> Python exception. C++ code of the bindings throws StatusError; a translator
// registered with pybind11 turns it into the exception class tessera/_errors.py picks for the
// status code (ValueError, FileNotFoundError, OSError, tessera.CorruptCheckpointError, ...),
// with the status message unchanged.
#ifndef TESSERA_PYTHON_PY_STATUS_H_
#define TESSERA_PYTHON_PY_STATUS_H_

#include <pybind11/pybind11.h>

#include <exception>
#include <string>
#include <utility>

#include "tessera/status.h"

namespace tessera::python {

class StatusError : public std::exception {
 public:
  explicit StatusError(Status status) : status_(std::move(status)), what_(status_.ToString()) {}
  const Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  Status status_;
  std::string what_;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

// `text` as a Python str: UTF-8 decoded, any byte that is not UTF-8 written as \xNN
// ("backslashreplace"), so that bytes of a corrupt checkpoint quoted in a message or a report
// never become a UnicodeDecodeError. Requires the GIL.
pybind11::str TextToStr(const std::string& text);

// The Python exception for `status` (not OK), built but not raised. Requires the GIL.
pybind11::object StatusToException(const Status& status);

// The status for the Python exception being handled (`error`), for C++ code that must return a
// Status (a Comm implemented in Python, a rank of run_local). Keeps the code of a tessera
// exception; anything else becomes `fallback` with "<ExceptionType>: <message>". Requires the
// GIL.
Status StatusFromPythonError(pybind11::error_already_set& error, StatusCode fallback,
                             const std::string& context);

void RegisterStatus(pybind11::module_& m);

}  // namespace tessera::python

#endif  // TESSERA_PYTHON_PY_STATUS_H_
