#include "py_status.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace tessera::python {

py::str TextToStr(const std::string& text) {
  PyObject* str =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "backslashreplace");
  if (str == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(str);
}

namespace {

// StatusDetail's fields as a dict (_errors.from_status reads it), or None.
py::object DetailToDict(const StatusDetail* detail) {
  if (!detail) return py::none();
  py::dict out;
  out["kind"] = static_cast<int>(detail->kind);
  py::list keys, options;
  for (const std::string& key : detail->keys) keys.append(TextToStr(key));
  for (const std::string& option : detail->options) options.append(TextToStr(option));
  out["keys"] = keys;
  out["options"] = options;
  out["advice"] = TextToStr(detail->advice);
  out["file"] = TextToStr(detail->file);
  out["offset"] = detail->offset;
  return out;
}

// The inverse, for _raise_status: a dict with any of StatusDetail's fields.
StatusDetail DetailFromDict(const py::dict& fields) {
  StatusDetail detail;
  if (fields.contains("kind")) {
    detail.kind = static_cast<StatusDetail::Kind>(fields["kind"].cast<int>());
  }
  if (fields.contains("keys")) detail.keys = fields["keys"].cast<std::vector<std::string>>();
  if (fields.contains("options")) {
    detail.options = fields["options"].cast<std::vector<std::string>>();
  }
  if (fields.contains("advice")) detail.advice = fields["advice"].cast<std::string>();
  if (fields.contains("file")) detail.file = fields["file"].cast<std::string>();
  if (fields.contains("offset")) detail.offset = fields["offset"].cast<int64_t>();
  return detail;
}

}  // namespace

py::object StatusToException(const Status& status) {
  py::object from_status = py::module_::import("tessera._errors").attr("from_status");
  return from_status(static_cast<int>(status.code()), std::string(StatusCodeName(status.code())),
                     TextToStr(status.message()), DetailToDict(status.detail()));
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
      [](int code, const std::string& message, std::optional<py::dict> detail) {
        if (code <= 0 || code > static_cast<int>(StatusCode::kDeadlineExceeded)) {
          throw py::value_error("not an error status code: " + std::to_string(code));
        }
        Status status(static_cast<StatusCode>(code), message);
        throw StatusError(detail ? status.WithDetail(DetailFromDict(*detail)) : status);
      },
      py::arg("code"), py::arg("message"), py::arg("detail") = py::none());
}

}  // namespace tessera::python
