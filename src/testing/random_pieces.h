// Random layouts in which a rank holds several pieces of one tensor (boxes and flat ranges,
// StateDict takes any number per key), for property tests of planning (src/plan), of save and
// load (src/checkpoint) and of the multi-rank suite (src/suite). Deterministic in the generator.
#ifndef TESSERA_TESTING_RANDOM_PIECES_H_
#define TESSERA_TESTING_RANDOM_PIECES_H_

#include <optional>
#include <random>
#include <vector>

#include "tessera/box.h"
#include "tessera/sharded_tensor.h"

namespace tessera::testing {

// One piece a rank holds: the box `box`, or with `flat` the elements [begin, end) of its
// row-major flattening (`box` is then the piece's local box).
struct PieceSpec {
  Box box;
  std::optional<FlatRange> flat;
  ReplicaId replica;  // empty: the main replica
  int64_t NumElements() const { return flat ? flat->end - flat->begin : box.NumElements(); }
};

// Cuts `box` into at most `max_pieces` boxes that tile it, by random cuts.
std::vector<Box> RandomTiling(const Box& box, std::mt19937_64& rng, size_t max_pieces);

// A random layout of a tensor of `shape` over `ranks` ranks: pieces[r] are rank r's pieces, in
// a random order. The tensor is tiled into up to 3 x ranks boxes; each box goes to one rank
// whole, or is cut into up to 4 consecutive flat ranges that go to random ranks (a rank may get
// several, adjacent or not, and empty ones), or (stacked layers, for a box of 2 dimensions or
// more) is cut along its first axis into boxes of extent 1, each given as the flat range of
// its whole box to a random rank. The pieces of one rank never share an element. With
// `replicas` some pieces are held by a second rank as well, with replica id {1} (only a main
// replica is written; a load may ask for any box from any rank, so no id is needed there).
std::vector<std::vector<PieceSpec>> RandomPiecesLayout(const Shape& shape, int ranks,
                                                       std::mt19937_64& rng, bool replicas);

// The ShardedTensor of `piece` of tensor `key` over `data`, which holds piece.NumElements()
// elements of `dtype`.
ShardedTensor PieceTensor(const std::string& key, const PieceSpec& piece, void* data, DType dtype,
                          const Shape& global_shape);

}  // namespace tessera::testing

#endif  // TESSERA_TESTING_RANDOM_PIECES_H_
