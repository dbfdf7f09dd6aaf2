#include "testing/random_pieces.h"

#include <algorithm>

namespace tessera::testing {

std::vector<Box> RandomTiling(const Box& box, std::mt19937_64& rng, size_t max_pieces) {
  std::vector<Box> pieces = {box};
  while (pieces.size() < max_pieces && rng() % 6 != 0) {
    const size_t i = rng() % pieces.size();
    Box b = pieces[i];
    if (b.rank() == 0) break;
    const size_t d = rng() % b.rank();
    if (b.sizes[d] < 2) continue;
    const int64_t cut = 1 + static_cast<int64_t>(rng() % (b.sizes[d] - 1));
    Box second = b;
    b.sizes[d] = cut;
    second.offsets[d] += cut;
    second.sizes[d] -= cut;
    pieces[i] = b;
    pieces.push_back(second);
  }
  return pieces;
}

namespace {

// A rank other than `not_this` (requires ranks > 1).
int OtherRank(int ranks, int not_this, std::mt19937_64& rng) {
  const int r = static_cast<int>(rng() % static_cast<uint64_t>(ranks - 1));
  return r >= not_this ? r + 1 : r;
}

// Cuts [0, n) into up to `max_parts` consecutive ranges (some may be empty).
std::vector<FlatRange> RandomCuts(int64_t n, std::mt19937_64& rng, size_t max_parts) {
  std::vector<int64_t> cuts = {0, n};
  const size_t parts = 1 + rng() % max_parts;
  for (size_t k = 1; k < parts; ++k) {
    cuts.push_back(n == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(n + 1)));
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<FlatRange> out;
  for (size_t k = 0; k + 1 < cuts.size(); ++k) out.push_back({cuts[k], cuts[k + 1]});
  return out;
}

}  // namespace

std::vector<std::vector<PieceSpec>> RandomPiecesLayout(const Shape& shape, int ranks,
                                                       std::mt19937_64& rng, bool replicas) {
  std::vector<std::vector<PieceSpec>> out(ranks);
  auto give = [&](int rank, PieceSpec piece) {
    if (replicas && ranks > 1 && rng() % 4 == 0) {
      PieceSpec copy = piece;
      copy.replica = {1};
      out[OtherRank(ranks, rank, rng)].push_back(std::move(copy));
    }
    out[rank].push_back(std::move(piece));
  };
  auto any_rank = [&] { return static_cast<int>(rng() % static_cast<uint64_t>(ranks)); };
  for (const Box& box : RandomTiling(Box::Whole(shape), rng, 3 * static_cast<size_t>(ranks))) {
    const uint64_t mode = rng() % 3;
    if (mode == 0) {
      give(any_rank(), PieceSpec{box, std::nullopt, {}});
    } else if (mode == 1 || box.rank() < 2) {
      for (const FlatRange& range : RandomCuts(box.NumElements(), rng, 4)) {
        give(any_rank(), PieceSpec{box, range, {}});
      }
    } else {
      // Stacked layers (Megatron's layers on a prepended axis): one box of extent 1 along the
      // first axis per layer, held whole by a rank or cut into flat ranges held by random ranks
      // (a distributed optimizer's bucket per layer), so a rank holds flat ranges of several
      // layers, which form no single flat range.
      for (int64_t layer = 0; layer < box.sizes[0]; ++layer) {
        Box one = box;
        one.offsets[0] += layer;
        one.sizes[0] = 1;
        if (rng() % 4 == 0) {
          give(any_rank(), PieceSpec{one, std::nullopt, {}});
          continue;
        }
        for (const FlatRange& range : RandomCuts(one.NumElements(), rng, 3)) {
          give(any_rank(), PieceSpec{one, range, {}});
        }
      }
    }
  }
  for (std::vector<PieceSpec>& pieces : out) std::shuffle(pieces.begin(), pieces.end(), rng);
  return out;
}

ShardedTensor PieceTensor(const std::string& key, const PieceSpec& piece, void* data, DType dtype,
                          const Shape& global_shape) {
  if (piece.flat) {
    return ShardedTensor::FlatShard(key, TensorView(data, dtype, {piece.NumElements()}),
                                    global_shape, piece.box.offsets, piece.box.sizes,
                                    piece.flat->begin, piece.replica);
  }
  return ShardedTensor::Shard(key, TensorView(data, dtype, piece.box.sizes), global_shape,
                              piece.box.offsets, piece.replica);
}

}  // namespace tessera::testing
