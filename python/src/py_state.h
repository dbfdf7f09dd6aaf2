// StateBuilder: the tessera::StateDict one call of save/load/async_save works on, built by the
// Python layer (tessera/_state.py) from the flattened state dict. Tensors are views of the
// caller's memory (zero copy): NumPy arrays and other buffer-protocol objects through the
// buffer protocol, torch tensors through their data pointer. The builder keeps every Python
// object it views alive (and its buffer exported) until it is destroyed.
//
// Not thread-safe; used by one Python call at a time.
#ifndef TESSERA_PYTHON_PY_STATE_H_
#define TESSERA_PYTHON_PY_STATE_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/state_dict.h"

namespace tessera::python {

// The sharding of one tensor, as given to tessera.ShardedTensor; empty fields take the
// ShardedTensor defaults (a whole tensor, the main replica).
struct TensorSpec {
  std::optional<Shape> global_shape;  // default: the data's shape
  std::vector<int64_t> global_offset;
  Shape local_shape;
  ReplicaId replica_id;
  std::optional<FlatRange> flat_range;
  bool allow_shape_mismatch = false;
  bool partial = false;
};

// The Python name of an object encoding: "pickle", "torch_save", "json" or "bytes" (the names
// tessera's Python layer decodes by).
const char* PythonEncodingName(ObjectEncoding encoding);

class StateBuilder {
 public:
  StateBuilder() = default;
  StateBuilder(const StateBuilder&) = delete;
  StateBuilder& operator=(const StateBuilder&) = delete;

  // A tensor viewing a buffer-protocol object (a NumPy array). `dtype` is a tessera dtype name
  // whose size must equal the buffer's item size. `writable`: the buffer will be loaded into.
  // Returns the entry's index.
  size_t AddBuffer(std::string key, pybind11::buffer data, const std::string& dtype,
                   const TensorSpec& spec, bool writable);
  // A tensor at address `data_ptr` (a torch tensor's data_ptr()) of `dtype` and `shape`,
  // contiguous row-major; `owner` is kept alive. With `cuda_device` >= 0 the address is memory
  // of that CUDA device and `stream` (a cudaStream_t as an integer: torch's current stream of
  // the device) orders it (TensorView::device, ::stream). Returns the entry's index.
  size_t AddPointer(std::string key, uintptr_t data_ptr, const std::string& dtype, Shape shape,
                    pybind11::object owner, const TensorSpec& spec, int cuda_device = -1,
                    uintptr_t stream = 0);
  // An object: opaque bytes. Returns the entry's index.
  // `pickled`: the bytes are a Python pickle (ObjectEncoding::kPickle), else kBytes.
  size_t AddObject(std::string key, std::string_view data, ReplicaId replica_id,
                   bool pickled = false);

  // The bytes of the object at `index` (after a load: what was loaded).
  pybind11::bytes ObjectData(size_t index) const;
  // What those bytes are (after a load: the stored encoding): "bytes", "pickle", "torch_save"
  // or "json" (ObjectInfo.encoding's names).
  std::string ObjectEncodingName(size_t index) const;

  StateDict& dict() { return dict_; }

 private:
  size_t Add(std::string key, TensorView view, const TensorSpec& spec);

  StateDict dict_;
  std::vector<std::unique_ptr<pybind11::buffer_info>> buffers_;  // exported while viewed
  std::vector<pybind11::object> owners_;
};

void RegisterState(pybind11::module_& m);

}  // namespace tessera::python

#endif  // TESSERA_PYTHON_PY_STATE_H_
