#include "core/tiling.h"

#include <algorithm>
#include <functional>
#include <map>
#include <queue>

namespace tessera {

// ---- tiling check ----------------------------------------------------------------------------
//
// Overlap is found by a sweep along the dimension with the most distinct chunk offsets (the
// most-split one). Boxes whose extent along it contains the sweep position are "active"; they
// are kept ordered by their offset in a second dimension, so a new box is compared only with
// the active boxes whose extent in that dimension reaches it. For the layouts checkpoints use
// (grids of TP/PP/DP splits, flat-range pieces) that is O(log n) per box: O(n log n) in all.
// Coverage follows from disjointness, bounds, and the volumes adding up to the whole.

namespace {

// Decimal digits of a non-negative 128-bit count.
std::string Int128ToString(__int128 v) {
  std::string digits;
  do {
    digits.push_back(static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  } while (v > 0);
  return std::string(digits.rbegin(), digits.rend());
}

// `boxes` is anything indexable whose elements give a Box through `box_of`.
template <typename Boxes, typename BoxOf>
std::optional<BoxCheckFailure> CheckTilingOf(const Boxes& items, BoxOf box_of, const Shape& shape,
                                             bool require_coverage) {
  struct View {  // boxes[i] reads like a vector of Box
    const Boxes& items;
    BoxOf& box_of;
    const Box& operator[](size_t i) const { return box_of(items[i]); }
    size_t size() const { return items.size(); }
  } boxes{items, box_of};
  const size_t rank = shape.size();
  // Exact in 128 bits: a shape of 64 dimensions may overflow even that (then `total` is
  // unknown, and no set of in-bounds boxes can be said to cover it).
  __int128 total = 1;
  bool total_overflows = false;
  for (int64_t s : shape) total_overflows |= __builtin_mul_overflow(total, s, &total);
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) total = 0, total_overflows = false;
  __int128 covered = 0;
  std::vector<uint32_t> order;
  order.reserve(boxes.size());
  for (uint32_t i = 0; i < boxes.size(); ++i) {
    if (!boxes[i].InBounds(shape)) {
      return BoxCheckFailure{
          "box " + boxes[i].ToString() + " is outside the global shape " + ShapeToString(shape), i,
          -1};
    }
    if (boxes[i].empty()) continue;
    covered += boxes[i].NumElements();
    order.push_back(i);
  }
  auto overlap_failure = [&](uint32_t a, uint32_t b) {
    return BoxCheckFailure{
        "boxes " + boxes[a].ToString() + " and " + boxes[b].ToString() + " overlap", a, b};
  };
  // Fast path: sorted along some dimension, consecutive boxes do not even overlap along it
  // (the row or column slices of TP/DP splits): no pair can overlap. The (offset, end) pairs
  // are copied out first: sorting them is a pass over one array, where sorting `order` would
  // follow two pointers per comparison (item, box) - most of the check's time at a million
  // chunks. Boxes usually arrive in offset order (a save's planner sorts them), so the sort is
  // skipped when they do.
  std::vector<std::pair<int64_t, int64_t>> extents;  // (offset, end) along one dimension
  auto disjoint_along = [&](size_t d) {
    extents.clear();
    extents.reserve(order.size());
    for (uint32_t i : order) extents.emplace_back(boxes[i].offsets[d], boxes[i].end(d));
    if (!std::is_sorted(extents.begin(), extents.end())) std::sort(extents.begin(), extents.end());
    for (size_t k = 1; k < extents.size(); ++k) {
      if (extents[k].first < extents[k - 1].second) return false;
    }
    return true;
  };
  if (rank == 0) {
    if (order.size() > 1) return overlap_failure(order[0], order[1]);
  } else if (order.size() > 1 && (disjoint_along(0) || (rank > 1 && disjoint_along(rank - 1)))) {
    // No overlap.
  } else if (order.size() > 1) {
    // The sweep dimension: most distinct offsets. The ordering dimension: the next most.
    std::vector<std::pair<size_t, size_t>> distinct(rank);  // (count, dim)
    std::vector<int64_t> values(order.size());
    for (size_t d = 0; d < rank; ++d) {
      for (size_t k = 0; k < order.size(); ++k) values[k] = boxes[order[k]].offsets[d];
      std::sort(values.begin(), values.end());
      distinct[d] = {std::unique(values.begin(), values.end()) - values.begin(), d};
    }
    std::sort(distinct.begin(), distinct.end(), std::greater<>());
    const size_t sweep = distinct[0].second;
    const size_t second = rank > 1 ? distinct[1].second : sweep;
    int64_t max_second_extent = 0;
    for (uint32_t i : order)
      max_second_extent = std::max(max_second_extent, boxes[i].sizes[second]);

    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return boxes[a].offsets[sweep] < boxes[b].offsets[sweep];
    });
    using ActiveMap = std::multimap<int64_t, uint32_t>;  // offset in `second` -> box
    ActiveMap active;
    // Expiry queue: (end along sweep, iterator into `active`).
    using Expiry = std::pair<int64_t, ActiveMap::iterator>;
    auto later = [](const Expiry& a, const Expiry& b) { return a.first > b.first; };
    std::priority_queue<Expiry, std::vector<Expiry>, decltype(later)> expiry(later);
    for (uint32_t i : order) {
      const Box& box = boxes[i];
      while (!expiry.empty() && expiry.top().first <= box.offsets[sweep]) {
        active.erase(expiry.top().second);
        expiry.pop();
      }
      if (rank == 1) {
        if (!active.empty()) return overlap_failure(active.begin()->second, i);
      } else {
        // Active boxes that may reach box in `second`: offset in (box.off - max_extent, box.end).
        auto it = active.upper_bound(box.offsets[second] - max_second_extent);
        for (; it != active.end() && it->first < box.end(second); ++it) {
          if (Intersect(boxes[it->second], box)) return overlap_failure(it->second, i);
        }
      }
      auto where = active.emplace(box.offsets[second], i);
      expiry.emplace(box.end(sweep), where);
    }
  }
  if (require_coverage && (total_overflows || covered != total)) {
    const std::string advice = "mark the tensor partial if that is intended";
    return BoxCheckFailure{"the boxes cover " + Int128ToString(covered) + " of the " +
                               (total_overflows ? "more than 2^127" : Int128ToString(total)) +
                               " elements of shape " + ShapeToString(shape) + " (" + advice + ")",
                           -1, -1, advice};
  }
  return std::nullopt;
}

}  // namespace

std::optional<BoxCheckFailure> CheckTiling(std::span<const Box> boxes, const Shape& shape,
                                           bool require_coverage) {
  return CheckTilingOf(
      boxes, [](const Box& b) -> const Box& { return b; }, shape, require_coverage);
}

std::optional<BoxCheckFailure> CheckTiling(std::span<const ChunkInfo> chunks, const Shape& shape,
                                           bool require_coverage) {
  return CheckTilingOf(
      chunks, [](const ChunkInfo& c) -> const Box& { return c.box; }, shape, require_coverage);
}

std::string BoxCheckFailure::problem() const {
  const std::string suffix = " (" + advice + ")";
  if (advice.empty() || !message.ends_with(suffix)) return message;
  return message.substr(0, message.size() - suffix.size());
}

}  // namespace tessera
