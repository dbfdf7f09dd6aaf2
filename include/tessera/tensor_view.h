// TensorView: a non-owning view of a dense, contiguous, row-major tensor in host memory.
#ifndef TESSERA_TENSOR_VIEW_H_
#define TESSERA_TENSOR_VIEW_H_

#include <cstddef>
#include <cstdint>

#include "tessera/box.h"
#include "tessera/dtype.h"

namespace tessera {

struct TensorView {
  // Not owned. Must stay valid (and, for a load, writable) for the duration of the call that
  // uses the view. May be null only when the view holds no bytes.
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;  // {} is a 0-d scalar holding one element

  TensorView() = default;
  // Takes const memory too (a save only reads); a load writes through `data`.
  TensorView(const void* data_in, DType dtype_in, Shape shape_in)
      : data(const_cast<void*>(data_in)), dtype(dtype_in), shape(std::move(shape_in)) {}

  // Product of the shape (1 for a scalar); INT64_MAX when it does not fit in an int64.
  int64_t NumElements() const;
  size_t NumBytes() const { return static_cast<size_t>(NumElements()) * DTypeSize(dtype); }
  std::byte* bytes() const { return static_cast<std::byte*>(data); }
};

}  // namespace tessera

#endif  // TESSERA_TENSOR_VIEW_H_
