// Dims: one number per dimension of a tensor (a Box's offsets or sizes), held inline for up to
// Dims::kInlineDims dimensions and on the heap beyond that.
//
// Why not std::vector: a save of 1024 ranks x 1024 tensors plans, checks, encodes and decodes a
// million boxes, and with two vectors a box every copy was two heap allocations and two frees:
// malloc and free were the largest part of planning (issue 32). Tensors of checkpoints have one
// to four dimensions almost always, so four inline numbers make a copied box allocation-free.
// Why not absl::InlinedVector or boost::container::small_vector: box.h is a public header, and
// neither library is otherwise a dependency of tessera or of the programs that include it; what
// a box needs is a short contiguous array of int64, which this class provides in one screen.
//
// The interface is the part of std::vector that boxes use. A Dims converts implicitly from a
// std::vector<int64_t> (a Shape) and to a std::span<const int64_t>; ToVector() makes a Shape.
#ifndef TESSERA_DIMS_H_
#define TESSERA_DIMS_H_

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <span>
#include <vector>

namespace tessera {

class Dims {
 public:
  static constexpr size_t kInlineDims = 4;
  using value_type = int64_t;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = int64_t&;
  using const_reference = const int64_t&;
  using pointer = int64_t*;
  using const_pointer = const int64_t*;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;

  Dims() noexcept = default;
  // `n` dimensions, each `value`.
  explicit Dims(size_t n, int64_t value = 0) { assign(n, value); }
  Dims(std::initializer_list<int64_t> values) { Assign(values.begin(), values.size()); }
  // Implicit, as a std::span is from a vector: code that builds a box from a Shape stays as it is.
  Dims(std::span<const int64_t> values) { Assign(values.data(), values.size()); }     // NOLINT
  Dims(const std::vector<int64_t>& values) { Assign(values.data(), values.size()); }  // NOLINT
  template <std::input_iterator It>
  Dims(It first, It last) {
    for (; first != last; ++first) push_back(*first);
  }

  Dims(const Dims& other) { Assign(other.data(), other.size()); }
  Dims(Dims&& other) noexcept { MoveFrom(other); }
  Dims& operator=(const Dims& other) {
    if (this != &other) Assign(other.data(), other.size());
    return *this;
  }
  Dims& operator=(Dims&& other) noexcept {
    if (this != &other) {
      Release();
      MoveFrom(other);
    }
    return *this;
  }
  ~Dims() { Release(); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return capacity_; }
  int64_t* data() { return on_heap() ? heap_ : inline_; }
  const int64_t* data() const { return on_heap() ? heap_ : inline_; }
  int64_t* begin() { return data(); }
  int64_t* end() { return data() + size_; }
  const int64_t* begin() const { return data(); }
  const int64_t* end() const { return data() + size_; }
  int64_t& operator[](size_t i) { return data()[i]; }
  int64_t operator[](size_t i) const { return data()[i]; }
  int64_t& front() { return data()[0]; }
  int64_t front() const { return data()[0]; }
  int64_t& back() { return data()[size_ - 1]; }
  int64_t back() const { return data()[size_ - 1]; }

  void reserve(size_t n) {
    if (n > capacity_) Grow(n);
  }
  // New dimensions are `value`.
  void resize(size_t n, int64_t value = 0) {
    reserve(n);
    if (on_heap()) {
      if (n > size_) std::fill(heap_ + size_, heap_ + n, value);
    } else {
      for (size_t i = size_; i < n && i < kInlineDims; ++i) inline_[i] = value;
    }
    size_ = static_cast<uint32_t>(n);
  }
  void assign(size_t n, int64_t value) {
    size_ = 0;
    resize(n, value);
  }
  void clear() { size_ = 0; }
  void push_back(int64_t value) {
    if (size_ == capacity_) Grow(2 * capacity_);
    data()[size_++] = value;
  }
  void pop_back() { --size_; }
  // Inserts `value` before `pos`; returns where it now is.
  iterator insert(const_iterator pos, int64_t value) {
    const size_t at = static_cast<size_t>(pos - begin());
    push_back(value);
    std::rotate(begin() + at, end() - 1, end());
    return begin() + at;
  }
  iterator erase(const_iterator pos) {
    const size_t at = static_cast<size_t>(pos - begin());
    std::copy(begin() + at + 1, end(), begin() + at);
    --size_;
    return begin() + at;
  }

  std::vector<int64_t> ToVector() const { return std::vector<int64_t>(begin(), end()); }

  friend bool operator==(const Dims& a, const Dims& b) {
    return a.size_ == b.size_ && std::equal(a.begin(), a.end(), b.begin());
  }
  friend std::strong_ordering operator<=>(const Dims& a, const Dims& b) {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }
  // Against a Shape, element by element (a box's sizes against a tensor's shape).
  friend bool operator==(const Dims& a, const std::vector<int64_t>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  }

 private:
  bool on_heap() const { return capacity_ > kInlineDims; }
  // The inline and heap cases are written apart so that the compiler sees the bound of the
  // inline array (GCC's -Warray-bounds cannot follow capacity_).
  void Assign(const int64_t* values, size_t n) {
    size_ = 0;
    if (!on_heap() && n <= kInlineDims) {
      std::copy_n(values, n, inline_);
    } else {
      reserve(n);
      std::copy_n(values, n, heap_);
    }
    size_ = static_cast<uint32_t>(n);
  }
  void Grow(size_t n) {
    n = std::max(n, 2 * kInlineDims);  // never back to an inline size (capacity_ says where)
    int64_t* bigger = new int64_t[n];
    if (on_heap()) {
      std::copy_n(heap_, size_, bigger);
    } else {
      std::copy_n(inline_, std::min<size_t>(size_, kInlineDims), bigger);
    }
    Release();
    heap_ = bigger;
    capacity_ = static_cast<uint32_t>(n);
  }
  void Release() {
    if (on_heap()) delete[] heap_;
    capacity_ = kInlineDims;
  }
  // Takes `other`'s numbers (its heap array, if any) and leaves it empty and inline.
  void MoveFrom(Dims& other) {
    size_ = other.size_;
    capacity_ = other.capacity_;
    if (other.on_heap()) {
      heap_ = other.heap_;
    } else {
      std::copy_n(other.inline_, std::min<size_t>(size_, kInlineDims), inline_);
    }
    other.size_ = 0;
    other.capacity_ = kInlineDims;
  }

  uint32_t size_ = 0;
  uint32_t capacity_ = kInlineDims;  // > kInlineDims exactly when the numbers are on the heap
  union {
    int64_t inline_[kInlineDims] = {};
    int64_t* heap_;
  };
};

}  // namespace tessera

#endif  // TESSERA_DIMS_H_
