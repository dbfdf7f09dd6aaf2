#include "tessera/box.h"

#include <algorithm>
#include <limits>

#include "tessera/tensor_view.h"

namespace tessera {

namespace {

// The product of `dims`: 0 when any is 0, else INT64_MAX when it overflows (never UB).
int64_t SaturatingProduct(std::span<const int64_t> dims) {
  for (int64_t d : dims) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : dims) {
    if (__builtin_mul_overflow(n, d, &n)) return std::numeric_limits<int64_t>::max();
  }
  return n;
}

// offset + size, exactly.
__int128 End128(int64_t offset, int64_t size) { return static_cast<__int128>(offset) + size; }

}  // namespace

int64_t Box::NumElements() const { return SaturatingProduct(sizes); }

bool Box::Contains(const Box& other) const {
  if (other.rank() != rank()) return false;
  for (size_t d = 0; d < rank(); ++d) {
    if (other.offsets[d] < offsets[d] ||
        End128(other.offsets[d], other.sizes[d]) > End128(offsets[d], sizes[d])) {
      return false;
    }
  }
  return true;
}

bool Box::InBounds(std::span<const int64_t> shape) const {
  if (shape.size() != rank()) return false;
  for (size_t d = 0; d < rank(); ++d) {
    if (offsets[d] < 0 || sizes[d] < 0 || End128(offsets[d], sizes[d]) > shape[d]) return false;
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
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const __int128 hi =
        std::min(End128(a.offsets[d], a.sizes[d]), End128(b.offsets[d], b.sizes[d]));
    if (hi <= lo) return std::nullopt;
    out.offsets[d] = lo;
    // Exact for valid boxes; wraps (defined, not UB) only for invalid ones.
    out.sizes[d] = static_cast<int64_t>(hi - lo);
  }
  return out;
}

std::vector<int64_t> RowMajorStrides(std::span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    if (__builtin_mul_overflow(s, shape[i], &s)) s = std::numeric_limits<int64_t>::max();
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

int64_t TensorView::NumElements() const { return SaturatingProduct(shape); }

}  // namespace tessera
