// Several pieces of one key on one rank (issue 21): boxes and flat ranges, each with its own
// memory, planned for save and load like any other items, and refused when they overlap.
#include "plan/local_pieces.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "plan/flat_range.h"
#include "plan/load_plan.h"
#include "plan/save_plan.h"
#include "testing/random_pieces.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using testing::PieceSpec;

// The global row-major index of every element of `piece`, in the order its memory holds them.
std::vector<int64_t> GlobalIndices(const PieceSpec& piece, const Shape& shape) {
  std::vector<int64_t> out;
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  const int64_t begin = piece.flat ? piece.flat->begin : 0;
  const int64_t end = piece.flat ? piece.flat->end : piece.box.NumElements();
  for (int64_t i = begin; i < end; ++i) {
    int64_t rest = i, global = 0;
    for (size_t d = piece.box.rank(); d-- > 0;) {
      global += (piece.box.offsets[d] + rest % piece.box.sizes[d]) * strides[d];
      rest /= piece.box.sizes[d];
    }
    out.push_back(global);
  }
  return out;
}

// One rank's state for `layout` over int64 buffers: values are the global indices (fill), or
// -1 (a load destination).
struct RankState {
  StateDict state;
  std::vector<std::vector<int64_t>> buffers;
  std::vector<std::vector<int64_t>> expected;  // per entry
};

RankState BuildState(const std::string& key, const Shape& shape,
                     const std::vector<PieceSpec>& pieces, bool fill) {
  RankState r;
  r.buffers.reserve(pieces.size());
  for (const PieceSpec& piece : pieces) {
    r.expected.push_back(GlobalIndices(piece, shape));
    r.buffers.push_back(fill ? r.expected.back()
                             : std::vector<int64_t>(r.expected.back().size(), -1));
    Status s =
        r.state.Add(testing::PieceTensor(key, piece, r.buffers.back().data(), DType::kI64, shape));
    EXPECT_OK(s);
  }
  return r;
}

// Saves the ranks' states (each rank's written items into a file of its own, in memory) and
// returns the manifest content; `files` receives the files.
Result<Metadata> SaveInMemory(const std::vector<RankState>& ranks, bool balance_writes,
                              std::vector<std::vector<uint8_t>>& files) {
  std::vector<LocalPlan> plans;
  for (const RankState& r : ranks) {
    TESSERA_ASSIGN_OR_RETURN(LocalPlan plan, BuildLocalPlan(r.state));
    // What travels to the coordinator.
    TESSERA_ASSIGN_OR_RETURN(LocalPlan decoded, DecodeLocalPlan(EncodeLocalPlan(plan)));
    plans.push_back(std::move(decoded));
  }
  TESSERA_ASSIGN_OR_RETURN(GlobalSavePlan global,
                           BuildGlobalSavePlan(plans, {.balance_writes = balance_writes}));
  std::vector<WriteResult> results(ranks.size());
  files.assign(ranks.size(), {});
  for (size_t r = 0; r < ranks.size(); ++r) {
    TESSERA_ASSIGN_OR_RETURN(LocalPlan local, BuildLocalPlan(ranks[r].state));
    for (uint32_t i : global.writes[r]) {
      const LocalItem& item = local.items[i];
      const auto& tensor = std::get<ShardedTensor>(ranks[r].state.entries()[item.entry_index]);
      const std::byte* from = tensor.data.bytes() + item.byte_offset;
      WrittenItem written;
      written.item = i;
      written.offset = files[r].size();
      written.length = item.num_bytes;
      files[r].insert(files[r].end(), reinterpret_cast<const uint8_t*>(from),
                      reinterpret_cast<const uint8_t*>(from) + item.num_bytes);
      results[r].items.push_back(written);
    }
    results[r].files.push_back({"rank" + std::to_string(r), files[r].size()});
  }
  return FinishMetadata(global, results);
}

// Plans `state`'s reads from `metadata` and executes them from the in-memory files.
Status LoadInMemory(const Metadata& metadata, const std::vector<std::vector<uint8_t>>& files,
                    RankState& r, uint64_t* bytes_read) {
  TESSERA_ASSIGN_OR_RETURN(RankReadPlan plan, PlanRankReads(metadata, r.state, "memory", false));
  if (!plan.permuted.empty()) return Internal("permuted copies planned");
  for (const ReadRun& run : plan.runs) {
    const std::vector<uint8_t>& file = files[run.file_index];
    if (run.file_offset + run.length > file.size()) return Internal("run past the file's end");
    std::memcpy(run.destination, file.data() + run.file_offset, run.length);
    *bytes_read += run.length;
  }
  return Status::Ok();
}

// Property (issue 21): a tensor saved from random layouts in which ranks hold several boxes and
// flat ranges of it (stacked layers with a flat range per layer among them), loaded into other
// such layouts, lands every element in the right place of the right piece, reading exactly the
// bytes needed; each unique element is written once.
TEST(LocalPiecesTest, RandomLayoutsWithSeveralPiecesPerRankRoundTrip) {
  const uint64_t seed = 2112;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 1000; ++trial) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " trial " + std::to_string(trial));
    const size_t dims = rng() % 5;
    Shape shape;
    for (size_t d = 0; d < dims; ++d) shape.push_back(1 + static_cast<int64_t>(rng() % 6));
    const int save_ranks = 1 + static_cast<int>(rng() % 5);
    const int load_ranks = 1 + static_cast<int>(rng() % 5);
    const auto save_layout = testing::RandomPiecesLayout(shape, save_ranks, rng, true);
    const auto load_layout = testing::RandomPiecesLayout(shape, load_ranks, rng, false);
    std::vector<RankState> saved;
    for (int r = 0; r < save_ranks; ++r)
      saved.push_back(BuildState("w", shape, save_layout[r], true));
    std::vector<std::vector<uint8_t>> files;
    ASSERT_OK_AND_ASSIGN(Metadata metadata, SaveInMemory(saved, trial % 2 == 1, files));
    ASSERT_EQ(metadata.tensors.size(), 1u);
    uint64_t written = 0;
    for (const auto& f : files) written += f.size();
    EXPECT_EQ(written, static_cast<uint64_t>(Box::Whole(shape).NumElements()) * 8);
    for (int r = 0; r < load_ranks; ++r) {
      RankState loaded = BuildState("w", shape, load_layout[r], false);
      uint64_t bytes_read = 0;
      ASSERT_OK(LoadInMemory(metadata, files, loaded, &bytes_read));
      uint64_t needed = 0;
      for (size_t e = 0; e < loaded.buffers.size(); ++e) {
        EXPECT_EQ(loaded.buffers[e], loaded.expected[e]) << "rank " << r << " piece " << e;
        needed += loaded.buffers[e].size() * 8;
      }
      EXPECT_EQ(bytes_read, needed);
    }
  }
}

// Planning does not depend on the order a rank adds its pieces in: the manifest's content is the
// same (chunks sorted by box).
TEST(LocalPiecesTest, PlansDoNotDependOnPieceOrder) {
  const uint64_t seed = 77;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 50; ++trial) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " trial " + std::to_string(trial));
    const Shape shape = {1 + static_cast<int64_t>(rng() % 6), 1 + static_cast<int64_t>(rng() % 9)};
    auto layout = testing::RandomPiecesLayout(shape, 3, rng, true);
    std::vector<RankState> a, b;
    for (auto& pieces : layout) {
      a.push_back(BuildState("w", shape, pieces, true));
      std::reverse(pieces.begin(), pieces.end());
      b.push_back(BuildState("w", shape, pieces, true));
    }
    std::vector<std::vector<uint8_t>> files_a, files_b;
    ASSERT_OK_AND_ASSIGN(Metadata ma, SaveInMemory(a, false, files_a));
    ASSERT_OK_AND_ASSIGN(Metadata mb, SaveInMemory(b, false, files_b));
    ASSERT_EQ(ma.tensors[0].chunks.size(), mb.tensors[0].chunks.size());
    for (size_t c = 0; c < ma.tensors[0].chunks.size(); ++c) {
      EXPECT_EQ(ma.tensors[0].chunks[c].box, mb.tensors[0].chunks[c].box);
    }
  }
}

std::vector<float> g_data(64);

ShardedTensor Dense(Box box, Shape shape) {
  return ShardedTensor::Shard("w", TensorView(g_data.data(), DType::kF32, box.sizes),
                              std::move(shape), box.offsets);
}

ShardedTensor Flat(Box box, Shape shape, int64_t begin, int64_t end) {
  return ShardedTensor::FlatShard("w", TensorView(g_data.data(), DType::kF32, {end - begin}),
                                  std::move(shape), box.offsets, box.sizes, begin);
}

// Overlap within a rank is refused by save and load planning, naming the key and both pieces.
TEST(LocalPiecesTest, OverlapWithinARankIsRefusedNamingKeyAndBothPieces) {
  struct Case {
    std::vector<ShardedTensor> pieces;
    std::string message;
  };
  const Shape shape = {4, 8};
  const std::vector<Case> cases = {
      {{Dense(Box({0, 0}, {2, 8}), shape), Dense(Box({1, 0}, {2, 8}), shape)},
       "tensor 'w': this rank holds pieces of it that overlap: local box [0:2, 0:8] and local "
       "box [1:3, 0:8] share the elements [1:2, 0:8]"},
      {{Dense(Box({0, 0}, {4, 8}), shape), Dense(Box({0, 0}, {4, 8}), shape)},
       "local box [0:4, 0:8] and local box [0:4, 0:8] share the elements [0:4, 0:8]"},
      // Two flat ranges of one layer: [3, 11) and [10, 12) share element 10 = (1, 2).
      {{Flat(Box({2, 0}, {2, 8}), shape, 3, 11), Flat(Box({2, 0}, {2, 8}), shape, 10, 12)},
       "local box [2:4, 0:8] flat range [3, 11) and local box [2:4, 0:8] flat range [10, 12) "
       "share the elements [3:4, 2:3]"},
      // A flat range of one box and a dense box inside it.
      {{Flat(Box({0, 0}, {4, 8}), shape, 5, 20), Dense(Box({1, 4}, {1, 2}), shape)},
       "local box [0:4, 0:8] flat range [5, 20) and local box [1:2, 4:6] share the elements "
       "[1:2, 4:6]"},
  };
  for (const Case& c : cases) {
    StateDict state;
    for (const ShardedTensor& t : c.pieces) ASSERT_OK(state.Add(t));
    Result<LocalPlan> plan = BuildLocalPlan(state);
    ASSERT_FALSE(plan.ok()) << c.message;
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(plan.status().message(), HasSubstr(c.message));
    Metadata metadata;
    metadata.tensors.push_back(TensorInfo{"w", DType::kF32, shape, {}});
    Result<RankReadPlan> reads = PlanRankReads(metadata, state, "memory", true);
    ASSERT_FALSE(reads.ok()) << c.message;
    EXPECT_THAT(reads.status().message(), HasSubstr(c.message));
  }
  // Touching pieces do not overlap: the tail of one layer, the head of the next, a whole one.
  StateDict state;
  ASSERT_OK(state.Add(Flat(Box({0, 0}, {1, 8}), shape, 6, 8)));
  ASSERT_OK(state.Add(Flat(Box({1, 0}, {1, 8}), shape, 0, 3)));
  ASSERT_OK(state.Add(Flat(Box({1, 0}, {1, 8}), shape, 5, 5)));  // empty
  ASSERT_OK(state.Add(Flat(Box({1, 0}, {1, 8}), shape, 3, 5)));
  ASSERT_OK(state.Add(Dense(Box({2, 0}, {1, 8}), shape)));
  ASSERT_OK_AND_ASSIGN(LocalPlan plan, BuildLocalPlan(state));
  EXPECT_EQ(plan.items.size(), 5u);  // the empty range still names the tensor
}

// Issue 21's case at scale: a distributed optimizer over 20000 stacked layers holds a flat range
// of each layer (one bucket per layer) on this rank: 20000 pieces of one key. Planning is
// O(n log n) in the pieces, so this takes well under a second; a quadratic check would take
// minutes.
TEST(LocalPiecesTest, ManyPiecesOfOneKeyPlanQuickly) {
  const int64_t layers = 20000, width = 16;
  const Shape shape = {layers, width};
  std::vector<float> data(layers * 5);
  StateDict state;
  for (int64_t l = 0; l < layers; ++l) {
    ASSERT_OK(state.Add(ShardedTensor::FlatShard(
        "w", TensorView(data.data() + 5 * l, DType::kF32, {5}), shape, {l, 0}, {1, width}, 3)));
  }
  ASSERT_OK_AND_ASSIGN(LocalPlan plan, BuildLocalPlan(state));
  EXPECT_EQ(plan.items.size(), static_cast<size_t>(layers));  // [3, 8) of a row: one box each
  Metadata metadata;
  TensorInfo info{"w", DType::kF32, shape, {}};
  info.chunks.push_back(ChunkInfo{.box = Box::Whole(shape)});
  info.chunks[0].location.length = layers * width * 4;
  metadata.tensors.push_back(info);
  metadata.files.push_back({"f", static_cast<uint64_t>(layers * width * 4)});
  ASSERT_OK_AND_ASSIGN(RankReadPlan reads, PlanRankReads(metadata, state, "memory", false));
  EXPECT_EQ(reads.runs.size(), static_cast<size_t>(layers));
  EXPECT_EQ(reads.bytes_needed, static_cast<uint64_t>(layers * 5 * 4));
}

// A key held in several pieces is listed once in the load report.
TEST(LocalPiecesTest, MissingKeyOfSeveralPiecesIsListedOnce) {
  StateDict state;
  const Shape shape = {4, 8};
  ASSERT_OK(state.Add(Dense(Box({0, 0}, {1, 8}), shape)));
  ASSERT_OK(state.Add(Dense(Box({2, 0}, {1, 8}), shape)));
  Metadata metadata;
  ASSERT_OK_AND_ASSIGN(RankReadPlan reads, PlanRankReads(metadata, state, "memory", true));
  EXPECT_EQ(reads.missing_keys, (std::vector<std::string>{"w"}));
  Result<RankReadPlan> strict = PlanRankReads(metadata, state, "memory", false);
  ASSERT_FALSE(strict.ok());
  EXPECT_THAT(strict.status().message(), HasSubstr("has no key 'w' (set"));
}

}  // namespace
}  // namespace tessera
