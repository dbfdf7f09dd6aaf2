// Several pieces of one tensor on one rank (StateDict takes any number per key: boxes and flat
// ranges, each with its own memory) must not share an element: a save would otherwise write
// two copies of it from one rank (which one is "the" value?), and a load would land one read in
// two places, which read sharing (one destination per distinct run) cannot do. Replicas on
// different ranks are not pieces of one rank: the save plan deduplicates those.
#ifndef TESSERA_PLAN_LOCAL_PIECES_H_
#define TESSERA_PLAN_LOCAL_PIECES_H_

#include <string>

#include "tessera/sharded_tensor.h"
#include "tessera/state_dict.h"
#include "tessera/status.h"

namespace tessera {

// Checks every key of which `state` holds several tensor pieces: their elements (the local
// box, or the part of it a flat range holds) are disjoint. O(n log n) in the number of pieces
// for the layouts checkpoints use (core/tiling.h); nothing to do for keys held in one piece.
// InvalidArgument naming the key, both pieces and an element box they share.
Status CheckLocalPiecesDisjoint(const StateDict& state);

// "local box [0:2, 0:8] flat range [3, 11)", or "local box [0:2, 0:8]" without a flat range.
std::string DescribePiece(const ShardedTensor& tensor);

}  // namespace tessera

#endif  // TESSERA_PLAN_LOCAL_PIECES_H_
