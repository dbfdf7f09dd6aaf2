#include "py_state.h"

#include <pybind11/stl.h>

#include <string_view>
#include <utility>
#include <variant>

#include "py_status.h"

namespace py = pybind11;

namespace tessera::python {
namespace {

// True when `info` describes a C-contiguous (row-major, dense) buffer. Strides of dimensions
// of size 1 do not matter; an empty buffer is contiguous.
bool IsRowMajor(const py::buffer_info& info) {
  for (py::ssize_t size : info.shape) {
    if (size == 0) return true;
  }
  py::ssize_t expected = info.itemsize;
  for (size_t d = info.shape.size(); d-- > 0;) {
    if (info.shape[d] != 1 && info.strides[d] != expected) return false;
    expected *= info.shape[d];
  }
  return true;
}

}  // namespace

size_t StateBuilder::AddBuffer(std::string key, py::buffer data, const std::string& dtype,
                               const TensorSpec& spec, bool writable) {
  const DType type = ValueOrThrow(DTypeFromName(dtype));
  auto info = std::make_unique<py::buffer_info>(data.request(/*writable=*/false));
  if (writable && info->readonly) {
    ThrowIfError(
        InvalidArgument("tensor '" + key + "': the array is read-only, and a load writes into it"));
  }
  if (static_cast<size_t>(info->itemsize) != DTypeSize(type)) {
    ThrowIfError(InvalidArgument("tensor '" + key + "': items of " +
                                 std::to_string(info->itemsize) + " bytes cannot hold dtype " +
                                 dtype));
  }
  if (!IsRowMajor(*info)) {
    ThrowIfError(InvalidArgument(
        "tensor '" + key +
        "': the array is not contiguous (tessera reads and writes row-major memory in place; "
        "pass numpy.ascontiguousarray(a) to save, or load into a contiguous array)"));
  }
  Shape shape(info->shape.begin(), info->shape.end());
  TensorView view(info->ptr, type, std::move(shape));
  const size_t index = Add(std::move(key), std::move(view), spec);
  buffers_.push_back(std::move(info));
  return index;
}

size_t StateBuilder::AddPointer(std::string key, uintptr_t data_ptr, const std::string& dtype,
                                Shape shape, py::object owner, const TensorSpec& spec,
                                int cuda_device, uintptr_t stream) {
  const DType type = ValueOrThrow(DTypeFromName(dtype));
  TensorView view(reinterpret_cast<const void*>(data_ptr), type, std::move(shape));
  if (cuda_device >= 0) {
    Result<std::shared_ptr<Device>> device = CudaDevice(cuda_device);
    ThrowIfError(device.status().WithContext("tensor '" + key + "'"));
    view.device = std::move(*device);
    view.stream = static_cast<DeviceStream>(stream);
  }
  const size_t index = Add(std::move(key), std::move(view), spec);
  owners_.push_back(std::move(owner));
  return index;
}

size_t StateBuilder::Add(std::string key, TensorView view, const TensorSpec& spec) {
  ShardedTensor tensor;
  tensor.key = std::move(key);
  tensor.global_shape = spec.global_shape ? *spec.global_shape : view.shape;
  tensor.data = std::move(view);
  tensor.global_offset = spec.global_offset;
  tensor.local_shape = spec.local_shape;
  tensor.replica_id = spec.replica_id;
  tensor.flat_range = spec.flat_range;
  tensor.allow_shape_mismatch = spec.allow_shape_mismatch;
  tensor.partial = spec.partial;
  ThrowIfError(dict_.Add(std::move(tensor)));
  return dict_.size() - 1;
}

size_t StateBuilder::AddObject(std::string key, std::string_view data, ReplicaId replica_id,
                               bool pickled) {
  ShardedObject object;
  object.key = std::move(key);
  object.encoding = pickled ? ObjectEncoding::kPickle : ObjectEncoding::kBytes;
  object.data.assign(data.begin(), data.end());
  object.replica_id = std::move(replica_id);
  ThrowIfError(dict_.Add(std::move(object)));
  return dict_.size() - 1;
}

py::bytes StateBuilder::ObjectData(size_t index) const {
  if (index >= dict_.size()) throw py::index_error("no entry " + std::to_string(index));
  const auto* object = std::get_if<ShardedObject>(&dict_.entries()[index]);
  if (!object) throw py::type_error("entry " + std::to_string(index) + " is a tensor");
  return py::bytes(reinterpret_cast<const char*>(object->data.data()), object->data.size());
}

const char* PythonEncodingName(ObjectEncoding encoding) {
  switch (encoding) {
    case ObjectEncoding::kPickle:
      return "pickle";
    case ObjectEncoding::kTorchSave:
      return "torch_save";
    case ObjectEncoding::kJson:
      return "json";
    default:
      return "bytes";
  }
}

std::string StateBuilder::ObjectEncodingName(size_t index) const {
  if (index >= dict_.size()) throw py::index_error("no entry " + std::to_string(index));
  const auto* object = std::get_if<ShardedObject>(&dict_.entries()[index]);
  if (!object) throw py::type_error("entry " + std::to_string(index) + " is a tensor");
  return PythonEncodingName(object->encoding);
}

namespace {

// The keyword arguments shared by add_buffer and add_pointer, as a TensorSpec.
TensorSpec MakeSpec(std::optional<Shape> global_shape, std::vector<int64_t> global_offset,
                    Shape local_shape, ReplicaId replica_id,
                    const std::optional<std::pair<int64_t, int64_t>>& flat_range,
                    bool allow_shape_mismatch, bool partial) {
  TensorSpec spec{std::move(global_shape),
                  std::move(global_offset),
                  std::move(local_shape),
                  std::move(replica_id),
                  std::nullopt,
                  allow_shape_mismatch,
                  partial};
  if (flat_range) spec.flat_range = FlatRange{flat_range->first, flat_range->second};
  return spec;
}

}  // namespace

void RegisterState(py::module_& m) {
  m.def("_built_with_cuda", &BuiltWithCuda,
        "Whether this tessera was built with CUDA (CUDA tensors can be saved and loaded).");
  py::class_<StateBuilder>(m, "StateBuilder",
                           "The entries of one save or load; built by tessera._state.")
      .def(py::init<>())
      .def("__len__", [](StateBuilder& s) { return s.dict().size(); })
      .def(
          "add_buffer",
          [](StateBuilder& s, std::string key, py::buffer data, const std::string& dtype,
             std::optional<Shape> global_shape, std::vector<int64_t> global_offset,
             Shape local_shape, ReplicaId replica_id,
             std::optional<std::pair<int64_t, int64_t>> flat_range, bool allow_shape_mismatch,
             bool partial, bool writable) {
            TensorSpec spec =
                MakeSpec(std::move(global_shape), std::move(global_offset), std::move(local_shape),
                         std::move(replica_id), flat_range, allow_shape_mismatch, partial);
            return s.AddBuffer(std::move(key), std::move(data), dtype, spec, writable);
          },
          py::arg("key"), py::arg("data"), py::arg("dtype"), py::arg("global_shape") = py::none(),
          py::arg("global_offset") = std::vector<int64_t>{}, py::arg("local_shape") = Shape{},
          py::arg("replica_id") = ReplicaId{}, py::arg("flat_range") = py::none(),
          py::arg("allow_shape_mismatch") = false, py::arg("partial") = false,
          py::arg("writable") = false)
      .def(
          "add_pointer",
          [](StateBuilder& s, std::string key, uintptr_t data_ptr, const std::string& dtype,
             Shape shape, py::object owner, std::optional<Shape> global_shape,
             std::vector<int64_t> global_offset, Shape local_shape, ReplicaId replica_id,
             std::optional<std::pair<int64_t, int64_t>> flat_range, bool allow_shape_mismatch,
             bool partial, int cuda_device, uintptr_t stream) {
            TensorSpec spec =
                MakeSpec(std::move(global_shape), std::move(global_offset), std::move(local_shape),
                         std::move(replica_id), flat_range, allow_shape_mismatch, partial);
            return s.AddPointer(std::move(key), data_ptr, dtype, std::move(shape), std::move(owner),
                                spec, cuda_device, stream);
          },
          py::arg("key"), py::arg("data_ptr"), py::arg("dtype"), py::arg("shape"), py::arg("owner"),
          py::arg("global_shape") = py::none(), py::arg("global_offset") = std::vector<int64_t>{},
          py::arg("local_shape") = Shape{}, py::arg("replica_id") = ReplicaId{},
          py::arg("flat_range") = py::none(), py::arg("allow_shape_mismatch") = false,
          py::arg("partial") = false, py::arg("cuda_device") = -1, py::arg("stream") = 0)
      .def(
          "add_object",
          [](StateBuilder& s, std::string key, py::bytes data, ReplicaId replica_id, bool pickled) {
            return s.AddObject(std::move(key), std::string_view(data), std::move(replica_id),
                               pickled);
          },
          py::arg("key"), py::arg("data"), py::arg("replica_id") = ReplicaId{},
          py::arg("pickled") = false)
      .def("object_data", &StateBuilder::ObjectData, py::arg("index"))
      .def("object_encoding", &StateBuilder::ObjectEncodingName, py::arg("index"));
}

}  // namespace tessera::python
