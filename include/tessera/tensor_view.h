// TensorView: a non-owning view of a dense, contiguous, row-major tensor in host memory, or in
// the memory of a device (include/tessera/device.h).
#ifndef TESSERA_TENSOR_VIEW_H_
#define TESSERA_TENSOR_VIEW_H_

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "tessera/box.h"
#include "tessera/device.h"
#include "tessera/dtype.h"

namespace tessera {

struct TensorView {
  // Not owned. Must stay valid (and, for a load, writable) for the duration of the call that
  // uses the view. May be null only when the view holds no bytes.
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;  // {} is a 0-d scalar holding one element
  // Where `data` points: host memory when null (the default), else memory of this device,
  // which tessera reaches only through copies on streams of its own.
  std::shared_ptr<Device> device;
  // With a device: the caller's stream for this memory. A save's copies wait for the work
  // queued on it when the save starts (AsyncSave: when the call is made); a load's copies wait
  // for it too, and it waits for them (work the caller queues on it after Load returns sees the
  // loaded bytes).
  DeviceStream stream = 0;

  TensorView() = default;
  // Takes const memory too (a save only reads); a load writes through `data`.
  TensorView(const void* data_in, DType dtype_in, Shape shape_in)
      : data(const_cast<void*>(data_in)), dtype(dtype_in), shape(std::move(shape_in)) {}
  // The same, from a Box's sizes (Dims). A template, so that a braced list ({} or {4, 8})
  // still means the Shape constructor.
  template <class Sizes>
  requires std::same_as<Sizes, Dims> TensorView(const void* data_in, DType dtype_in,
                                                const Sizes& shape_in)
      : TensorView(data_in, dtype_in, shape_in.ToVector()) {}
  // A view of memory of `device`, ordered on the caller's `stream`.
  static TensorView OnDevice(std::shared_ptr<Device> device, DeviceStream stream, const void* data,
                             DType dtype, Shape shape) {
    TensorView view(data, dtype, std::move(shape));
    view.device = std::move(device);
    view.stream = stream;
    return view;
  }

  bool on_device() const { return device != nullptr; }

  // Product of the shape (1 for a scalar); INT64_MAX when it does not fit in an int64.
  int64_t NumElements() const;
  size_t NumBytes() const { return static_cast<size_t>(NumElements()) * DTypeSize(dtype); }
  std::byte* bytes() const { return static_cast<std::byte*>(data); }
};

}  // namespace tessera

#endif  // TESSERA_TENSOR_VIEW_H_
