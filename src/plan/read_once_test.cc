#include "plan/read_once.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kCell = 1000;

CellNeed Need(uint32_t tensor, uint32_t chunk, uint64_t chunk_bytes, uint64_t begin, uint64_t end,
              CellCheck check = CellCheck::kEachCell, uint64_t needed = 0) {
  const uint64_t span = std::min(end * kCell, chunk_bytes) - begin * kCell;
  return {tensor, chunk, chunk_bytes, begin, end, needed ? needed : span, check};
}

// Which ranks need each cell of each chunk, from the lists.
using CellHolders = std::map<std::tuple<uint32_t, uint32_t, uint64_t>, std::vector<int32_t>>;
CellHolders HoldersOf(const std::vector<std::vector<CellNeed>>& lists,
                      const std::vector<int32_t>& group_of) {
  CellHolders holders;
  for (size_t r = 0; r < group_of.size(); ++r) {
    for (const CellNeed& n : lists[group_of[r]]) {
      for (uint64_t c = n.cell_begin; c < n.cell_end; ++c) {
        holders[{n.tensor, n.chunk, c}].push_back(static_cast<int32_t>(r));
      }
    }
  }
  return holders;
}

// Every cell needed by two or more ranks lies in exactly one piece, read by one of them and
// received by the others; no cell needed by one rank only is in a piece unless its chunk is read
// whole.
void ExpectEachSharedCellOnce(const JobReadPlan& plan, const CellHolders& holders) {
  std::map<std::tuple<uint32_t, uint32_t, uint64_t>, int> seen;
  for (const SharedPiece& p : plan.pieces) {
    ASSERT_EQ(p.begin % kCell, 0u);
    for (uint64_t c = p.begin / kCell; c * kCell < p.end; ++c) {
      const auto key = std::make_tuple(p.tensor, p.chunk, c);
      ++seen[key];
      auto it = holders.find(key);
      if (it == holders.end()) {
        EXPECT_EQ(p.check, CellCheck::kWholeChunk) << "a cell nobody needs is read";
        continue;
      }
      std::vector<int32_t> expected = it->second;
      expected.erase(std::remove(expected.begin(), expected.end(), p.reader), expected.end());
      if (p.check != CellCheck::kWholeChunk) {
        EXPECT_NE(std::find(it->second.begin(), it->second.end(), p.reader), it->second.end())
            << "the reader of cell " << c << " needs it";
      }
      EXPECT_EQ(plan.Receivers(p), expected) << "cell " << c;
    }
  }
  for (const auto& [key, ranks] : holders) {
    if (ranks.size() >= 2) {
      EXPECT_EQ(seen[key], 1) << "cell " << std::get<2>(key);
    }
  }
  for (const auto& [key, count] : seen) EXPECT_EQ(count, 1);
}

TEST(ReadOnceTest, OverlappingNeedsOfTwoGroupsShareOnlyWhatTwoRanksNeed) {
  // Ranks 0 and 1 need cells 0-2 and 2-4 of a 5.5-cell chunk: only cell 2 is shared.
  const std::vector<std::vector<CellNeed>> lists = {{Need(0, 0, 5500, 0, 3)},
                                                    {Need(0, 0, 5500, 2, 6)}};
  const std::vector<int32_t> group_of = {0, 1};
  ASSERT_OK_AND_ASSIGN(JobReadPlan plan, PlanJobReads(lists, group_of, kCell, 1 << 20));
  ASSERT_EQ(plan.pieces.size(), 1u);
  EXPECT_EQ(plan.pieces[0].begin, 2000u);
  EXPECT_EQ(plan.pieces[0].end, 3000u);
  EXPECT_EQ(plan.pieces[0].check, CellCheck::kEachCell);
  EXPECT_EQ(plan.union_needed_bytes, 5500u);
  ExpectEachSharedCellOnce(plan, HoldersOf(lists, group_of));
}

TEST(ReadOnceTest, ReplicasSplitTheReadingEvenly) {
  // Eight replicas of one list of 64 cells, one cell a piece: eight cells each.
  const std::vector<std::vector<CellNeed>> lists = {{Need(3, 1, 64 * kCell, 0, 64)}};
  const std::vector<int32_t> group_of(8, 0);
  ASSERT_OK_AND_ASSIGN(JobReadPlan plan, PlanJobReads(lists, group_of, kCell, kCell * 8));
  std::vector<uint64_t> load(8, 0);
  for (const SharedPiece& p : plan.pieces) load[p.reader] += p.end - p.begin;
  for (uint64_t l : load) EXPECT_EQ(l, 8 * kCell);
  EXPECT_EQ(plan.union_needed_bytes, 64 * kCell);
  EXPECT_EQ(plan.once_read_bytes, 64 * kCell);
  EXPECT_EQ(plan.alone_read_bytes, 8 * 64 * kCell);
  EXPECT_EQ(plan.exchanged_bytes, 7 * 64 * kCell);
  ExpectEachSharedCellOnce(plan, HoldersOf(lists, group_of));
}

// Pieces are cut at max_piece_bytes (the storage's read size: 8 MiB by default, S3's
// read_chunk_bytes), within the exchange bound: a larger cap makes fewer, larger pieces of the
// same cells.
TEST(ReadOnceTest, PiecesAreCutAtTheMaximumPieceSize) {
  constexpr uint64_t kBigCell = 1 << 20;
  const uint64_t chunk = 64 * kBigCell;
  const std::vector<std::vector<CellNeed>> lists = {
      {{0, 0, chunk, 0, 64, chunk, CellCheck::kEachCell}}};
  const std::vector<int32_t> group_of = {0, 0};
  for (const auto& [cap, exchange, want] :
       {std::tuple<uint64_t, uint64_t, uint64_t>{kDefaultMaxPieceBytes, 1ull << 30, 8 << 20},
        {32ull << 20, 1ull << 30, 32 << 20},
        {32ull << 20, 16ull << 20, 8 << 20}}) {  // a piece and its one copy within 16 MiB
    ASSERT_OK_AND_ASSIGN(JobReadPlan plan, PlanJobReads(lists, group_of, kBigCell, exchange, cap));
    ASSERT_EQ(plan.pieces.size(), chunk / want) << cap << " " << exchange;
    uint64_t covered = 0;
    for (const SharedPiece& p : plan.pieces) {
      EXPECT_EQ(p.end - p.begin, want);
      covered += p.end - p.begin;
    }
    EXPECT_EQ(covered, chunk);
  }
}

TEST(ReadOnceTest, DisjointSlicesOfTheSameCellsAddUpInTheUnion) {
  // Two tensor-parallel ranks each need half of every cell (a column slice of row-major rows).
  const std::vector<std::vector<CellNeed>> lists = {
      {Need(0, 0, 10 * kCell, 0, 10, CellCheck::kEachCell, 5 * kCell)},
      {Need(0, 0, 10 * kCell, 0, 10, CellCheck::kEachCell, 5 * kCell)}};
  const std::vector<int32_t> group_of = {1, 0};
  ASSERT_OK_AND_ASSIGN(JobReadPlan plan, PlanJobReads(lists, group_of, kCell, 1 << 20));
  EXPECT_EQ(plan.union_needed_bytes, 10 * kCell);
  ExpectEachSharedCellOnce(plan, HoldersOf(lists, group_of));
}

TEST(ReadOnceTest, AChunkWithOneChecksumIsReadWholeByOneRankWhenTheJobNeedsAllOfIt) {
  const std::vector<std::vector<CellNeed>> lists = {
      {Need(0, 0, 9500, 0, 6, CellCheck::kWholeChunk)},
      {Need(0, 0, 9500, 4, 10, CellCheck::kWholeChunk)}};
  const std::vector<int32_t> group_of = {0, 1};
  ASSERT_OK_AND_ASSIGN(JobReadPlan plan, PlanJobReads(lists, group_of, kCell, 3 * kCell));
  ASSERT_FALSE(plan.pieces.empty());
  EXPECT_EQ(plan.pieces.front().begin, 0u);
  EXPECT_EQ(plan.pieces.back().end, 9500u);
  for (const SharedPiece& p : plan.pieces) {
    EXPECT_EQ(p.reader, plan.pieces[0].reader);
    EXPECT_EQ(p.check, CellCheck::kWholeChunk);
  }
  ExpectEachSharedCellOnce(plan, HoldersOf(lists, group_of));

  // Needed in part: only the shared cells, unchecked.
  const std::vector<std::vector<CellNeed>> partial = {
      {Need(0, 0, 9500, 0, 5, CellCheck::kWholeChunk)},
      {Need(0, 0, 9500, 4, 7, CellCheck::kWholeChunk)}};
  ASSERT_OK_AND_ASSIGN(plan, PlanJobReads(partial, group_of, kCell, 3 * kCell));
  ASSERT_EQ(plan.pieces.size(), 1u);
  EXPECT_EQ(plan.pieces[0].check, CellCheck::kNone);
  EXPECT_EQ(plan.pieces[0].begin, 4000u);

  // verify_partial_chunks: read whole anyway, the gaps included.
  const std::vector<std::vector<CellNeed>> always = {
      {Need(0, 0, 9500, 1, 2, CellCheck::kWholeChunkAlways)},
      {Need(0, 0, 9500, 5, 6, CellCheck::kWholeChunkAlways)}};
  ASSERT_OK_AND_ASSIGN(plan, PlanJobReads(always, group_of, kCell, 1 << 20));
  ASSERT_EQ(plan.pieces.front().begin, 0u);
  ASSERT_EQ(plan.pieces.back().end, 9500u);
  ExpectEachSharedCellOnce(plan, HoldersOf(always, group_of));
}

TEST(ReadOnceTest, RoundsKeepEachReadersMemoryWithinTheBound) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 8);
    const int groups = 1 + static_cast<int>(rng() % ranks);
    std::vector<int32_t> group_of(ranks);
    for (int r = 0; r < ranks; ++r)
      group_of[r] = r < groups ? r : static_cast<int32_t>(rng() % groups);
    std::vector<std::vector<CellNeed>> lists(groups);
    for (auto& list : lists) {
      for (uint32_t t = 0; t < 3; ++t) {
        if (rng() % 3 == 0) continue;
        const uint64_t cells = 1 + rng() % 40;
        const uint64_t b = rng() % cells, e = b + 1 + rng() % (cells - b);
        const CellCheck check = static_cast<CellCheck>(rng() % 4);
        list.push_back(Need(t, 0, cells * kCell - rng() % kCell, b, e, check));
      }
    }
    // Every group agrees on each chunk's length and check kind.
    std::map<uint32_t, CellNeed> first;
    for (auto& list : lists) {
      for (CellNeed& n : list) {
        auto [it, inserted] = first.try_emplace(n.tensor, n);
        n.chunk_bytes = it->second.chunk_bytes;
        n.check = it->second.check;
        const uint64_t cells = (n.chunk_bytes + kCell - 1) / kCell;
        n.cell_end = std::min(n.cell_end, cells);
        n.cell_begin = std::min(n.cell_begin, n.cell_end - 1);
        n.needed_bytes = std::min(n.cell_end * kCell, n.chunk_bytes) - n.cell_begin * kCell;
      }
    }
    const uint64_t cap = kCell * (1 + rng() % 20);
    ASSERT_OK_AND_ASSIGN(JobReadPlan plan, PlanJobReads(lists, group_of, kCell, cap));
    ExpectEachSharedCellOnce(plan, HoldersOf(lists, group_of));
    std::map<std::pair<int32_t, uint32_t>, std::pair<uint64_t, int>> memory;  // (reader, round)
    for (const SharedPiece& p : plan.pieces) {
      auto& [bytes, count] = memory[{p.reader, p.round}];
      const uint64_t copies = (p.end - p.begin) * (1 + plan.NumReceivers(p));
      bytes += copies;
      ++count;
      EXPECT_LT(p.round, plan.num_rounds);
      // Only a piece of one cell may exceed the bound alone.
      EXPECT_TRUE(copies <= cap || p.end - p.begin <= kCell) << "trial " << trial;
    }
    for (const auto& [key, value] : memory) {
      EXPECT_TRUE(value.first <= cap || value.second == 1) << "trial " << trial;
    }
    // The same input gives the same plan, from the lists or from their encodings.
    std::vector<Bytes> encoded;
    for (const auto& list : lists) encoded.push_back(EncodeNeeds(list));
    const std::vector<std::span<const uint8_t>> spans(encoded.begin(), encoded.end());
    ASSERT_OK_AND_ASSIGN(JobReadPlan again, PlanJobReadsEncoded(spans, group_of, kCell, cap));
    ASSERT_EQ(again.pieces.size(), plan.pieces.size());
    for (size_t i = 0; i < plan.pieces.size(); ++i) {
      EXPECT_EQ(again.pieces[i].reader, plan.pieces[i].reader);
      EXPECT_EQ(again.pieces[i].round, plan.pieces[i].round);
      EXPECT_EQ(again.pieces[i].begin, plan.pieces[i].begin);
      EXPECT_EQ(again.pieces[i].end, plan.pieces[i].end);
    }
    EXPECT_EQ(again.holder_groups, plan.holder_groups);
    EXPECT_EQ(again.union_needed_bytes, plan.union_needed_bytes);
    EXPECT_EQ(again.alone_read_bytes, plan.alone_read_bytes);
    EXPECT_EQ(again.once_read_bytes, plan.once_read_bytes);
  }
}

TEST(ReadOnceTest, NeedListsRoundTripAndBadOnesAreNamed) {
  std::vector<CellNeed> needs = {Need(1, 0, 5000, 3, 5), Need(0, 2, 4000, 0, 2),
                                 Need(1, 0, 5000, 0, 3)};
  CoalesceNeeds(needs, kCell);
  ASSERT_EQ(needs.size(), 2u);
  EXPECT_EQ(needs[1].cell_begin, 0u);
  EXPECT_EQ(needs[1].cell_end, 5u);
  EXPECT_EQ(needs[1].needed_bytes, 5000u);
  const Bytes encoded = EncodeNeeds(needs);
  ASSERT_OK_AND_ASSIGN(std::vector<CellNeed> decoded, DecodeNeeds(encoded));
  ASSERT_EQ(decoded.size(), 2u);
  EXPECT_EQ(decoded[1].cell_end, 5u);

  Bytes huge = encoded;
  huge[0] = huge[1] = huge[2] = 0xff;
  EXPECT_THAT(DecodeNeeds(huge).status().message(), HasSubstr("claims"));
  Bytes trailing = encoded;
  trailing.push_back(0);
  EXPECT_THAT(DecodeNeeds(trailing).status().message(), HasSubstr("trailing"));
  Bytes cut = encoded;
  cut.pop_back();
  EXPECT_THAT(DecodeNeeds(cut).status().message(), HasSubstr("ends inside"));
  // Numbers are varints: the largest round-trip; one of more than 64 bits is refused.
  const CellNeed big = {UINT32_MAX,
                        UINT32_MAX,
                        UINT64_MAX,
                        UINT64_MAX - 2,
                        UINT64_MAX - 1,
                        UINT64_MAX,
                        CellCheck::kWholeChunk};
  ASSERT_OK_AND_ASSIGN(std::vector<CellNeed> big_back, DecodeNeeds(EncodeNeeds({&big, 1})));
  ASSERT_EQ(big_back.size(), 1u);
  EXPECT_EQ(big_back[0].tensor, UINT32_MAX);
  EXPECT_EQ(big_back[0].chunk_bytes, UINT64_MAX);
  EXPECT_EQ(big_back[0].cell_end, UINT64_MAX - 1);
  EXPECT_EQ(big_back[0].needed_bytes, UINT64_MAX);
  Bytes wide = {1, 0, 0, 0};
  for (int i = 0; i < 10; ++i) wide.push_back(0xff);
  wide.push_back(0x01);
  wide.insert(wide.end(), 6, 0);
  EXPECT_THAT(DecodeNeeds(wide).status().message(), HasSubstr("more than 64 bits"));
  // Planning from encodings names the group whose list does not decode.
  const std::vector<int32_t> pair = {0, 1};
  const std::vector<std::span<const uint8_t>> bad_second = {encoded, cut};
  EXPECT_THAT(PlanJobReadsEncoded(bad_second, pair, kCell, kCell).status().message(),
              HasSubstr("need list of rank 1, entry 1"));
  const std::vector<std::span<const uint8_t>> bad_count = {huge, encoded};
  EXPECT_THAT(PlanJobReadsEncoded(bad_count, pair, kCell, kCell).status().message(),
              HasSubstr("need list of rank 0: read plan: need list of"));

  const std::vector<int32_t> two = {0, 1};
  std::vector<std::vector<CellNeed>> lists = {{Need(0, 0, 5000, 0, 9)}, {}};
  EXPECT_THAT(PlanJobReads(lists, two, kCell, kCell).status().message(),
              HasSubstr("rank 0, entry 0 (tensor 0 chunk 0): cells [0, 9) outside"));
  lists = {{Need(0, 0, 5000, 0, 2)}, {Need(0, 0, 6000, 0, 2)}};
  EXPECT_THAT(PlanJobReads(lists, two, kCell, kCell).status().message(),
              HasSubstr("rank 0 and rank 1 disagree on tensor 0 chunk 0"));
  // Errors name the ranks of a list (a few, then how many more).
  const std::vector<int32_t> seven = {0, 1, 0, 1, 1, 1, 1};
  EXPECT_THAT(PlanJobReads(lists, seven, kCell, kCell).status().message(),
              HasSubstr("ranks 0 and 2 and ranks 1, 3, 4 and 2 more disagree"));
  lists = {{Need(0, 0, 5000, 2, 4), Need(0, 0, 5000, 0, 3)}, {}};
  EXPECT_THAT(PlanJobReads(lists, two, kCell, kCell).status().message(),
              HasSubstr("not sorted and disjoint"));
}

}  // namespace
}  // namespace tessera
