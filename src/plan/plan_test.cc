#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "plan/flat_range.h"
#include "plan/load_plan.h"
#include "plan/read_sharing.h"
#include "plan/save_plan.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Row-major linear index of global coordinate `at` inside `box`.
int64_t LinearIn(const Box& box, const std::vector<int64_t>& at) {
  int64_t index = 0;
  for (size_t d = 0; d < box.rank(); ++d) index = index * box.sizes[d] + (at[d] - box.offsets[d]);
  return index;
}

// Calls fn(coordinates) for every element of `box` in row-major order.
void ForEachElement(const Box& box, const std::function<void(const std::vector<int64_t>&)>& fn) {
  if (box.empty()) return;
  std::vector<int64_t> at = box.offsets.ToVector();
  while (true) {
    fn(at);
    size_t d = box.rank();
    while (d > 0) {
      --d;
      if (++at[d] < box.end(d)) break;
      at[d] = box.offsets[d];
      if (d == 0) return;
    }
    if (box.rank() == 0) return;
  }
}

TEST(FlatRangeTest, PiecesAreConsecutiveAndAtMostTwoNMinusOne) {
  std::mt19937_64 rng(1234);
  for (int trial = 0; trial < 2000; ++trial) {
    SCOPED_TRACE("seed 1234 trial " + std::to_string(trial));
    size_t rank = rng() % 5;
    Box local;
    for (size_t d = 0; d < rank; ++d) {
      local.offsets.push_back(static_cast<int64_t>(rng() % 4));
      local.sizes.push_back(static_cast<int64_t>(1 + rng() % 5));
    }
    int64_t n = local.NumElements();
    int64_t begin = static_cast<int64_t>(rng() % (n + 1));
    int64_t end = begin + static_cast<int64_t>(rng() % (n - begin + 1));
    std::vector<FlatPiece> pieces = FlatRangeToBoxes(local, begin, end);
    EXPECT_LE(pieces.size(), rank == 0 ? 1 : 2 * rank - 1);
    int64_t next = begin;
    for (const FlatPiece& piece : pieces) {
      ASSERT_TRUE(local.Contains(piece.box)) << piece.box.ToString() << " in " << local.ToString();
      EXPECT_EQ(piece.flat_begin, next);
      ForEachElement(piece.box, [&](const std::vector<int64_t>& at) {
        EXPECT_EQ(LinearIn(local, at), next) << piece.box.ToString();
        ++next;
      });
    }
    EXPECT_EQ(next, end);
  }
}

TEST(FlatRangeTest, ExampleTwoDimensional) {
  // 3x4 box at (10, 20); elements 2..9: the end of row 0, row 1, the start of row 2.
  std::vector<FlatPiece> pieces = FlatRangeToBoxes(Box({10, 20}, {3, 4}), 2, 10);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].box, Box({10, 22}, {1, 2}));
  EXPECT_EQ(pieces[1].box, Box({11, 20}, {1, 4}));
  EXPECT_EQ(pieces[2].box, Box({12, 20}, {1, 2}));
}

// Splits `box` recursively into a random tiling.
void RandomTiling(const Box& box, std::mt19937_64& rng, int depth, std::vector<Box>& out) {
  if (depth == 0 || box.empty() || rng() % 4 == 0) {
    out.push_back(box);
    return;
  }
  size_t d = rng() % box.rank();
  if (box.sizes[d] < 2) {
    out.push_back(box);
    return;
  }
  int64_t cut = 1 + static_cast<int64_t>(rng() % (box.sizes[d] - 1));
  Box a = box, b = box;
  a.sizes[d] = cut;
  b.offsets[d] += cut;
  b.sizes[d] -= cut;
  RandomTiling(a, rng, depth - 1, out);
  RandomTiling(b, rng, depth - 1, out);
}

bool BruteForceOverlap(const std::vector<Box>& boxes) {
  for (size_t i = 0; i < boxes.size(); ++i)
    for (size_t j = i + 1; j < boxes.size(); ++j)
      if (!boxes[i].empty() && !boxes[j].empty() && Intersect(boxes[i], boxes[j])) return true;
  return false;
}

TEST(CheckTilingTest, AgreesWithBruteForce) {
  const uint64_t seed = 99;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 500; ++trial) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " trial " + std::to_string(trial));
    size_t rank = 1 + rng() % 4;
    Shape shape;
    for (size_t d = 0; d < rank; ++d) shape.push_back(static_cast<int64_t>(1 + rng() % 9));
    std::vector<Box> boxes;
    RandomTiling(Box::Whole(shape), rng, 6, boxes);
    EXPECT_FALSE(CheckTiling(boxes, shape, true).has_value());
    // Perturb one box: grow it (overlap or out of bounds) or drop it (gap).
    size_t victim = rng() % boxes.size();
    std::vector<Box> changed = boxes;
    if (rng() % 2 == 0) {
      size_t d = rng() % rank;
      if (changed[victim].offsets[d] > 0) {
        changed[victim].offsets[d] -= 1;
        changed[victim].sizes[d] += 1;
      }
    } else {
      changed.erase(changed.begin() + victim);
    }
    bool expect_bad = BruteForceOverlap(changed) || changed.size() < boxes.size();
    if (changed == boxes) expect_bad = false;
    auto failure = CheckTiling(changed, shape, true);
    EXPECT_EQ(failure.has_value(), expect_bad) << (failure ? failure->message : "no failure");
    if (BruteForceOverlap(changed)) {
      ASSERT_TRUE(failure.has_value());
      EXPECT_THAT(failure->message, HasSubstr("overlap"));
    }
  }
}

TEST(CheckTilingTest, ReportsBoundsAndCoverage) {
  auto out = CheckTiling(std::vector<Box>{Box({0, 0}, {2, 5})}, {4, 4}, true);
  ASSERT_TRUE(out);
  EXPECT_THAT(out->message, HasSubstr("outside the global shape [4, 4]"));
  out = CheckTiling(std::vector<Box>{Box({0, 0}, {2, 4})}, {4, 4}, true);
  ASSERT_TRUE(out);
  EXPECT_THAT(out->message, HasSubstr("cover 8 of the 16 elements"));
  // The advice is the saver's; a reader of an index reports the problem alone.
  EXPECT_EQ(out->message, out->problem() + " (" + out->advice + ")");
  EXPECT_EQ(out->problem(), "the boxes cover 8 of the 16 elements of shape [4, 4]");
  EXPECT_FALSE(CheckTiling(std::vector<Box>{Box({0, 0}, {2, 4})}, {4, 4}, false));
  // Scalars: one box is the whole tensor; two overlap.
  EXPECT_FALSE(CheckTiling(std::vector<Box>{Box()}, {}, true));
  EXPECT_TRUE(CheckTiling(std::vector<Box>{Box(), Box()}, {}, true));
}

// Issue 11, item 8: the element count of a shape beyond int64 was printed truncated ("the
// boxes cover 4 of the 0 elements"), and a 64-dimension shape overflowed the count.
TEST(CheckTilingTest, CoverageMessageCountsBeyondInt64Exactly) {
  auto out = CheckTiling(std::vector<Box>{Box({0, 0}, {2, 2})},
                         {int64_t{1} << 32, int64_t{1} << 32}, true);
  ASSERT_TRUE(out);
  EXPECT_THAT(out->message, HasSubstr("cover 4 of the 18446744073709551616 elements"));
  const Shape huge(64, int64_t{1} << 40);
  out = CheckTiling(std::vector<Box>{Box(std::vector<int64_t>(64, 0), Shape(64, 1))}, huge, true);
  ASSERT_TRUE(out);
  EXPECT_THAT(out->message, HasSubstr("cover 1 of the more than 2^127 elements"));
}

TEST(CheckTilingTest, MillionChunkRowSlicesAreFast) {
  std::vector<Box> boxes;
  for (int64_t i = 0; i < 1 << 20; ++i) boxes.push_back(Box({i * 2, 0}, {2, 64}));
  std::reverse(boxes.begin(), boxes.end());
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(CheckTiling(boxes, {int64_t{2} << 20, 64}, true));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);  // pairwise would take hours; this is generous for a loaded machine
}

LocalItem TensorItem(std::string key, Box box, Shape shape, ReplicaId replica = {},
                     DType dtype = DType::kF32) {
  LocalItem item;
  item.key = std::move(key);
  item.kind = ItemKind::kTensor;
  item.dtype = dtype;
  item.global_shape = std::move(shape);
  item.num_bytes = box.NumElements() * DTypeSize(dtype);
  item.box = std::move(box);
  item.replica_id = std::move(replica);
  return item;
}

TEST(GlobalSavePlanTest, DeduplicatesReplicasAndWritesMainReplica) {
  // TP=2 x DP=2: ranks 0,1 hold the two halves (replica 0), ranks 2,3 their copies.
  std::vector<LocalPlan> plans(4);
  for (int r = 0; r < 4; ++r) {
    int tp = r % 2, dp = r / 2;
    plans[r].items.push_back(TensorItem("w", Box({tp * 4, 0}, {4, 8}), {8, 8}, {0, dp}));
    plans[r].items.push_back(TensorItem("norm", Box({0}, {8}), {8}, {tp, dp}));
  }
  ASSERT_OK_AND_ASSIGN(GlobalSavePlan plan, BuildGlobalSavePlan(plans, {}));
  ASSERT_EQ(plan.metadata.tensors.size(), 2u);
  EXPECT_EQ(plan.metadata.tensors[0].key, "norm");
  EXPECT_EQ(plan.metadata.tensors[0].chunks.size(), 1u);
  EXPECT_EQ(plan.metadata.tensors[1].chunks.size(), 2u);
  EXPECT_EQ(plan.writes[0], (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(plan.writes[1], (std::vector<uint32_t>{0}));
  EXPECT_TRUE(plan.writes[2].empty());
  EXPECT_TRUE(plan.writes[3].empty());
  EXPECT_EQ(plan.total_bytes, (64 + 8) * 4u);
}

TEST(GlobalSavePlanTest, BalanceWritesSpreadsReplicatedShards) {
  // 4 ranks each hold all 8 row blocks of a replicated tensor.
  std::vector<LocalPlan> plans(4);
  for (int r = 0; r < 4; ++r) {
    for (int b = 0; b < 8; ++b) {
      plans[r].items.push_back(TensorItem("t" + std::to_string(b), Box({0}, {16}), {16}, {r}));
    }
  }
  ASSERT_OK_AND_ASSIGN(GlobalSavePlan plain, BuildGlobalSavePlan(plans, {}));
  EXPECT_EQ(plain.writes[0].size(), 8u);
  ASSERT_OK_AND_ASSIGN(GlobalSavePlan balanced,
                       BuildGlobalSavePlan(plans, {.balance_writes = true}));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(balanced.writes[r].size(), 2u) << "rank " << r;
}

TEST(GlobalSavePlanTest, ErrorsNameKeyBoxesAndRanks) {
  std::vector<LocalPlan> plans(2);
  plans[0].items.push_back(TensorItem("a", Box({0}, {6}), {10}));
  plans[1].items.push_back(TensorItem("a", Box({4}, {6}), {10}));
  Result<GlobalSavePlan> r = BuildGlobalSavePlan(plans, {});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("key 'a'"));
  EXPECT_THAT(r.status().message(), HasSubstr("[0:6] and [4:10] overlap"));
  EXPECT_THAT(r.status().message(), HasSubstr("rank 0 and rank 1"));

  plans[1].items[0] = TensorItem("a", Box({6}, {4}), {10}, {}, DType::kBF16);
  r = BuildGlobalSavePlan(plans, {});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("dtype F32 on rank 0 but BF16 on rank 1"));

  plans[1].items[0] = TensorItem("a", Box({6}, {4}), {11});
  r = BuildGlobalSavePlan(plans, {});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("global shape [10] on rank 0 but [11] on rank 1"));

  plans[1].items[0] = TensorItem("a", Box({6}, {3}), {10});
  r = BuildGlobalSavePlan(plans, {});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("cover 9 of the 10"));

  plans[1].items[0] = TensorItem("a", Box({6}, {4}), {10}, {0});
  plans[0].items[0] = TensorItem("a", Box({0}, {6}), {10}, {0});
  EXPECT_OK(BuildGlobalSavePlan(plans, {}));
  plans[1].items[0].replica_id = {2};
  r = BuildGlobalSavePlan(plans, {});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("none holds the main replica"));

  // Alone, a rank is not named: its replica id is.
  std::vector<LocalPlan> one(1);
  one[0].items.push_back(TensorItem("a", Box({0}, {10}), {10}, {1, 2}));
  r = BuildGlobalSavePlan(one, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "key 'a' box [0:10] has replica id [1, 2] and nothing holds its main replica (replica "
            "id all zeros), the copy that is written");
}

// 64 ranks x 40 tensors (row blocks, some replicated, some objects): the plan built on one
// thread and on several is the same, and so is the first error (by key) when two keys are bad.
TEST(GlobalSavePlanTest, ThePlanAndItsFirstErrorDoNotDependOnTheThreadCount) {
  constexpr int kRanks = 64, kTensors = 40;
  std::vector<LocalPlan> plans(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    for (int t = 0; t < kTensors; ++t) {
      const std::string key = "t" + std::to_string(t);
      if (t % 7 == 0) {  // replicated on every rank
        plans[r].items.push_back(TensorItem(key, Box({0}, {16}), {16}, {r}));
      } else {
        plans[r].items.push_back(TensorItem(key, Box({4 * r, 0}, {4, 8}), {4 * kRanks, 8}));
      }
    }
    LocalItem object;
    object.key = "obj" + std::to_string(r % 3);
    object.kind = ItemKind::kObject;
    object.num_bytes = 5;
    object.replica_id = {r / 3 == 0 ? 0 : 1};
    plans[r].items.push_back(object);
  }
  ASSERT_OK_AND_ASSIGN(GlobalSavePlan one, BuildGlobalSavePlan(plans, {.threads = 1}));
  ASSERT_OK_AND_ASSIGN(GlobalSavePlan four, BuildGlobalSavePlan(plans, {.threads = 4}));
  EXPECT_EQ(one.metadata, four.metadata);
  EXPECT_EQ(one.writes, four.writes);
  EXPECT_EQ(one.chunk_writers, four.chunk_writers);
  EXPECT_EQ(one.object_writers, four.object_writers);
  EXPECT_EQ(one.total_bytes, four.total_bytes);
  EXPECT_EQ(one.metadata.tensors.size(), static_cast<size_t>(kTensors));
  EXPECT_EQ(one.metadata.objects.size(), 3u);

  // Two bad keys: t3 (an overlap) and t12 (a gap); "t12" < "t3", so t12's error wins.
  plans[5].items[3].box = Box({4 * 5 + 1, 0}, {4, 8});
  plans[9].items[12].box = Box({4 * 9, 0}, {3, 8});
  Result<GlobalSavePlan> bad_one = BuildGlobalSavePlan(plans, {.threads = 1});
  Result<GlobalSavePlan> bad_four = BuildGlobalSavePlan(plans, {.threads = 4});
  ASSERT_FALSE(bad_one.ok());
  EXPECT_EQ(bad_one.status().message(), bad_four.status().message());
  EXPECT_THAT(bad_one.status().message(), HasSubstr("key 't12'"));
}

TEST(LocalPlanTest, EncodeDecodeRoundTrip) {
  LocalPlan plan;
  plan.items.push_back(TensorItem("x.weight", Box({1, 2}, {3, 4}), {8, 8}, {0, 3}));
  LocalItem object;
  object.key = "rng";
  object.kind = ItemKind::kObject;
  object.num_bytes = 17;
  plan.items.push_back(object);
  ASSERT_OK_AND_ASSIGN(LocalPlan back, DecodeLocalPlan(EncodeLocalPlan(plan)));
  ASSERT_EQ(back.items.size(), 2u);
  EXPECT_EQ(back.items[0].key, "x.weight");
  EXPECT_EQ(back.items[0].box, plan.items[0].box);
  EXPECT_EQ(back.items[0].replica_id, plan.items[0].replica_id);
  EXPECT_EQ(back.items[1].kind, ItemKind::kObject);
  EXPECT_EQ(back.items[1].num_bytes, 17u);
  Bytes truncated = EncodeLocalPlan(plan);
  truncated.resize(truncated.size() - 3);
  EXPECT_FALSE(DecodeLocalPlan(truncated).ok());
}

// Property: random saved tiling of a random tensor (values = global linear index), random
// requested box; the planned runs, executed with memcpy from an in-memory "file", fill the
// destination exactly, and never read more bytes than the box needs.
TEST(LoadPlanTest, RandomReshardingIsExact) {
  const uint64_t seed = 7;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " trial " + std::to_string(trial));
    size_t rank = rng() % 5;
    Shape shape;
    for (size_t d = 0; d < rank; ++d) shape.push_back(static_cast<int64_t>(1 + rng() % 7));
    Box whole = Box::Whole(shape);
    std::vector<Box> boxes;
    if (rank == 0)
      boxes.push_back(whole);
    else
      RandomTiling(whole, rng, 5, boxes);
    // Lay the chunks out in one file, row-major each, values = global linear index.
    Metadata metadata;
    metadata.files.push_back({"f", 0});
    TensorInfo tensor{"t", DType::kI32, shape, {}};
    std::vector<int32_t> file;
    for (const Box& b : boxes) {
      ChunkInfo chunk{b, {0, file.size() * 4, static_cast<uint64_t>(b.NumElements()) * 4, 0}};
      ForEachElement(b, [&](const std::vector<int64_t>& at) {
        file.push_back(static_cast<int32_t>(LinearIn(whole, at)));
      });
      if (rank == 0) file.push_back(0);
      tensor.chunks.push_back(chunk);
    }
    metadata.tensors.push_back(tensor);
    ChunkIndex index(metadata.tensors[0]);
    Box want;
    for (size_t d = 0; d < rank; ++d) {
      int64_t lo = static_cast<int64_t>(rng() % shape[d]);
      int64_t hi = lo + 1 + static_cast<int64_t>(rng() % (shape[d] - lo));
      want.offsets.push_back(lo);
      want.sizes.push_back(hi - lo);
    }
    std::vector<int32_t> out(want.NumElements(), -1);
    std::vector<ReadRun> runs;
    std::vector<PermutedCopy> permuted;
    int64_t covered = PlanTensorReads(metadata, 0, index, want, want,
                                      reinterpret_cast<std::byte*>(out.data()), runs, permuted);
    EXPECT_TRUE(permuted.empty());
    EXPECT_EQ(covered, want.NumElements());
    CoalesceRuns(runs);
    uint64_t bytes = 0;
    for (const ReadRun& run : runs) {
      std::memcpy(run.destination,
                  reinterpret_cast<const std::byte*>(file.data()) + run.file_offset, run.length);
      bytes += run.length;
    }
    EXPECT_EQ(bytes, static_cast<uint64_t>(want.NumElements()) * 4);
    size_t k = 0;
    ForEachElement(
        want, [&](const std::vector<int64_t>& at) { EXPECT_EQ(out[k++], LinearIn(whole, at)); });
  }
}

TEST(ReadSharingTest, EachRunReadOnceByAHolderAndExchangeRoundsAreCapped) {
  // Ranks 0-3 all need runs A (100 B) and B (50 B); rank 2 alone needs C (10 B).
  const RunKey a{0, 0, 100, 100}, b{0, 100, 50, 50}, c{1, 0, 10, 10};
  std::vector<std::vector<RunKey>> runs = {{a, b}, {a, b}, {a, b, c}, {a, b}};
  ReadAssignment assignment = AssignReads(runs);
  ASSERT_EQ(assignment.unique.size(), 3u);
  std::vector<uint64_t> read(4, 0);
  for (size_t u = 0; u < assignment.unique.size(); ++u) {
    const auto& holders = assignment.holders[u];
    EXPECT_NE(std::find(holders.begin(), holders.end(), assignment.reader[u]), holders.end());
    read[assignment.reader[u]] += assignment.unique[u].length;
  }
  EXPECT_EQ(assignment.reader[2], 2);  // C: only rank 2 needs it, so it goes first, to rank 2
  EXPECT_EQ(read[0] + read[1] + read[2] + read[3], 160u);
  EXPECT_EQ(assignment.reader[0], 0);  // A: least loaded, ties by rank
  EXPECT_EQ(assignment.reader[1], 1);  // B: rank 0 now has 100 bytes
  std::vector<std::vector<ExchangePiece>> rounds = ScheduleExchange(assignment, 4, 40);
  uint64_t sent = 0;
  for (const auto& round : rounds) {
    std::vector<uint64_t> per_rank(4, 0);
    for (const ExchangePiece& p : round) {
      per_rank[assignment.reader[p.unique_run]] += p.length;
      sent += p.length;
      EXPECT_NE(p.unique_run, 2u) << "C is needed by one rank: never exchanged";
    }
    for (uint64_t bytes : per_rank) EXPECT_LE(bytes, 40u);
  }
  EXPECT_EQ(sent, 150u);
  EXPECT_EQ(rounds.size(), 3u);  // A takes 100/40 -> 3 rounds; B fits alongside
}

}  // namespace
}  // namespace tessera
