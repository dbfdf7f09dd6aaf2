// Box: a hyper-rectangle of a tensor in global coordinates. Everything about sharding is
// arithmetic on boxes. A 0-d tensor (a scalar) has the box with no dimensions, which holds
// one element.
#ifndef TESSERA_BOX_H_
#define TESSERA_BOX_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessera/dims.h"

namespace tessera {

using Shape = std::vector<int64_t>;

// A box is valid when every size is >= 0, every offset + size and the product of the sizes fit
// in an int64 (StateDict::Add and the manifest reader check this before anything else sees a
// box). Every member is defined for any box, valid or not: arithmetic that would overflow
// saturates instead of invoking undefined behaviour, and the checks compare exactly.
struct Box {
  Dims offsets;  // first index per dimension
  Dims sizes;    // extent per dimension, >= 0

  Box() = default;
  Box(Dims offsets_in, Dims sizes_in)
      : offsets(std::move(offsets_in)), sizes(std::move(sizes_in)) {}
  // The box [0, shape) of a whole tensor.
  static Box Whole(std::span<const int64_t> shape) { return Box(Dims(shape.size(), 0), shape); }
  static Box Whole(const Shape& shape) { return Whole(std::span<const int64_t>(shape)); }

  size_t rank() const { return sizes.size(); }
  // Product of sizes (1 for a 0-d box; 0 when any size is 0). INT64_MAX when the product does
  // not fit (an invalid box).
  int64_t NumElements() const;
  bool empty() const { return NumElements() == 0; }
  // offsets[dim] + sizes[dim], saturated at INT64_MAX / INT64_MIN (an invalid box).
  int64_t end(size_t dim) const {
    int64_t e;
    if (!__builtin_add_overflow(offsets[dim], sizes[dim], &e)) return e;
    return sizes[dim] < 0 ? INT64_MIN : INT64_MAX;
  }

  // True when `other` lies entirely inside this box (same rank). An empty `other` is inside
  // any box whose bounds contain its offsets.
  bool Contains(const Box& other) const;
  // True when the box lies inside [0, shape).
  bool InBounds(std::span<const int64_t> shape) const;
  bool InBounds(const Shape& shape) const { return InBounds(std::span<const int64_t>(shape)); }

  // "[0:128, 256:512]"; "[]" for a scalar.
  std::string ToString() const;

  friend bool operator==(const Box&, const Box&) = default;
  friend auto operator<=>(const Box&, const Box&) = default;
};

// The common part of two boxes of the same rank, or nullopt when they do not share an element.
std::optional<Box> Intersect(const Box& a, const Box& b);

// Row-major strides, in elements, of a dense tensor of `shape` (saturated at INT64_MAX where
// they would overflow, which happens only for a shape that holds no element or is too large).
std::vector<int64_t> RowMajorStrides(std::span<const int64_t> shape);
inline std::vector<int64_t> RowMajorStrides(const Shape& shape) {
  return RowMajorStrides(std::span<const int64_t>(shape));
}

// "[4, 8]".
std::string ShapeToString(std::span<const int64_t> shape);

}  // namespace tessera

#endif  // TESSERA_BOX_H_
