#include "tessera/box.h"

#include <algorithm>

#include "tessera/tensor_view.h"

namespace tessera {

int64_t Box::NumElements() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool Box::Contains(const Box& other) const {
  if (other.rank() != rank()) return false;
  for (size_t d = 0; d < rank(); ++d) {
    if (other.offsets[d] < offsets[d] || other.end(d) > end(d)) return false;
  }
  return true;
}

bool Box::InBounds(const Shape& shape) const {
  if (shape.size() != rank()) return false;
  for (size_t d = 0; d < rank(); ++d) {
    if (offsets[d] < 0 || sizes[d] < 0 || end(d) > shape[d]) return false;
  }
  return true;
}

std::string Box::ToString() const {
  std::string out = "[";
  for (size_t d = 0; d < rank(); ++d) {
    if (d) out += ", ";
    out += std::to_string(offsets[d]) + ":" + std::to_string(end(d));
  }
  return out + "]";
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank()) return std::nullopt;
  Box out;
  out.offsets.resize(a.rank());
  out.sizes.resize(a.rank());
  for (size_t d = 0; d < a.rank(); ++d) {
    int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    int64_t hi = std::min(a.end(d), b.end(d));
    if (hi <= lo) return std::nullopt;
    out.offsets[d] = lo;
    out.sizes[d] = hi - lo;
  }
  return out;
}

std::vector<int64_t> RowMajorStrides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

std::string ShapeToString(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

int64_t TensorView::NumElements() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

}  // namespace tessera
