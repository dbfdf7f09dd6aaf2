#include "plan/flat_range.h"

namespace tessera {
namespace {

// Appends the boxes covering flat elements [begin, end) of the sub-box of `local` whose
// leading prefix.size() dimensions are fixed at `prefix` (coordinates relative to `local`).
// `base` is the flat index of that sub-box's first element.
void Decompose(const Box& local, std::vector<int64_t>& prefix, int64_t base, int64_t begin,
               int64_t end, std::vector<FlatPiece>& out) {
  if (begin >= end) return;
  const size_t d = prefix.size();
  const size_t rank = local.rank();
  // A box with dims < d fixed at prefix, dim d spanning [lo, hi) (when d < rank), later dims
  // whole.
  auto emit = [&](int64_t lo, int64_t hi, int64_t flat_begin) {
    Box box{std::vector<int64_t>(rank), std::vector<int64_t>(rank)};
    for (size_t j = 0; j < rank; ++j) {
      if (j < d) {
        box.offsets[j] = local.offsets[j] + prefix[j];
        box.sizes[j] = 1;
      } else if (j == d) {
        box.offsets[j] = local.offsets[j] + lo;
        box.sizes[j] = hi - lo;
      } else {
        box.offsets[j] = local.offsets[j];
        box.sizes[j] = local.sizes[j];
      }
    }
    out.push_back({std::move(box), flat_begin});
  };
  if (d == rank) {  // every dimension fixed: the one element
    emit(0, 0, base);
    return;
  }
  int64_t inner = 1;  // elements per index of dim d
  for (size_t j = d + 1; j < rank; ++j) inner *= local.sizes[j];
  if (inner == 0) return;
  int64_t first = begin / inner, first_rem = begin % inner;
  int64_t last = end / inner, last_rem = end % inner;
  if (first == last) {  // inside one index of dim d
    prefix.push_back(first);
    Decompose(local, prefix, base + first * inner, first_rem, last_rem, out);
    prefix.pop_back();
    return;
  }
  if (first_rem != 0) {  // head: the rest of index `first`
    prefix.push_back(first);
    Decompose(local, prefix, base + first * inner, first_rem, inner, out);
    prefix.pop_back();
    ++first;
  }
  if (last > first) emit(first, last, base + first * inner);  // whole indices
  if (last_rem != 0) {                                        // tail: the start of index `last`
    prefix.push_back(last);
    Decompose(local, prefix, base + last * inner, 0, last_rem, out);
    prefix.pop_back();
  }
}

}  // namespace

std::vector<FlatPiece> FlatRangeToBoxes(const Box& local_box, int64_t begin, int64_t end) {
  std::vector<FlatPiece> out;
  std::vector<int64_t> prefix;
  prefix.reserve(local_box.rank());
  Decompose(local_box, prefix, 0, begin, end, out);
  return out;
}

}  // namespace tessera
