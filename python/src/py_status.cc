#include "py_status.h"

#include <string>

namespace py = pybind11;

namespace tessera::python {

py::str TextToStr(const std::string& text) {
  PyObject* str =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "backslashreplace");
  if (str == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(str);
}

py::object StatusToException(const Status& status) {
  py::object from_status = py::module_::import("tessera._errors").attr("from_status");
  return from_status(static_cast<int>(status.code()), std::string(StatusCodeName(status.code())),
                     TextToStr(status.message()));
}

Status StatusFromPythonError(py::error_already_set& error, StatusCode fallback,
                             const std::string& context) {
  const py::object& value = error.value();
  std::string message;
  StatusCode code = fallback;
  try {
    message = py::str(value);
    if (py::hasattr(value, "status_code")) {
      const int number = value.attr("status_code").cast<int>();
      if (number > 0 && number <= static_cast<int>(StatusCode::kDeadlineExceeded)) {
        code = static_cast<StatusCode>(number);
      }
    } else {
      message =
          py::str(py::type::handle_of(value).attr("__name__")).cast<std::string>() + ": " + message;
    }
  } catch (py::error_already_set&) {
    message = error.what();
  }
  return Status(code, context.empty() ? message : context + ": " + message);
}

void RegisterStatus(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object exception = StatusToException(e.status());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
    }
  });
  // For tests of the mapping: raises the exception a status of `code` becomes.
  m.def(
      "_raise_status",
      [](int code, const std::string& message) {
        if (code <= 0 || code > static_cast<int>(StatusCode::kDeadlineExceeded)) {
          throw py::value_error("not an error status code: " + std::to_string(code));
        }
        throw StatusError(Status(static_cast<StatusCode>(code), message));
      },
      py::arg("code"), py::arg("message"));
}

}  // namespace tessera::python
