// Flat ranges: a distributed optimizer's shard is the elements [begin, end) of the row-major
// flattening of a local box. Planning turns it into at most 2N-1 boxes (N = rank of the box),
// each contiguous in that flattening, so nothing past planning needs to know about flat ranges.
#ifndef TESSERA_PLAN_FLAT_RANGE_H_
#define TESSERA_PLAN_FLAT_RANGE_H_

#include <cstdint>
#include <vector>

#include "tessera/box.h"

namespace tessera {

struct FlatPiece {
  Box box;                 // global coordinates
  int64_t flat_begin = 0;  // flat index, in the local box, of this box's first element
};

// Boxes, in order, whose concatenation is elements [begin, end) of the row-major flattening
// of `local_box`. Requires 0 <= begin <= end <= local_box.NumElements(). Empty for an empty
// range.
std::vector<FlatPiece> FlatRangeToBoxes(const Box& local_box, int64_t begin, int64_t end);

}  // namespace tessera

#endif  // TESSERA_PLAN_FLAT_RANGE_H_
