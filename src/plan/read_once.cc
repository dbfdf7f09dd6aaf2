#include "plan/read_once.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include "core/byte_io.h"

namespace tessera {
namespace {

constexpr size_t kEncodedNeedBytes = 4 + 4 + 8 + 8 + 8 + 8 + 1;
// The largest piece one reader is given at a time: small enough to balance the reads of a few
// large chunks across ranks, large enough that a piece costs one storage request per 8 MiB.
constexpr uint64_t kMaxPieceBytes = 8ull << 20;

uint64_t CellBytesOf(const CellNeed& n, uint64_t cell_bytes) {
  return std::min(n.cell_end * cell_bytes, n.chunk_bytes) - n.cell_begin * cell_bytes;
}

// A need of the plan's input, with the group whose list holds it.
struct GroupNeed {
  CellNeed need;
  int32_t group;
};

// A range of cells of one chunk needed by a constant set of groups (none: a gap of a chunk read
// whole).
struct NeedRange {
  uint64_t cell_begin, cell_end;
  std::vector<int32_t> groups;  // ascending
  uint64_t num_ranks;           // their members
  uint64_t bytes = 0;           // of the cells
  uint64_t needed = 0;          // of them, by some rank (the union's estimate)
};

// One reader's task in the assignment: pieces [first, last) of the plan, read by one rank.
struct Task {
  uint32_t first, last;
  uint64_t bytes;
  uint64_t num_holders;
  std::vector<int32_t> candidates;  // groups whose members may read it
};

// Cuts one chunk's needs (sorted by cell_begin) into ranges of constant holders, and estimates
// the union of their needed bytes.
std::vector<NeedRange> SweepChunk(std::span<const GroupNeed> needs, uint64_t cell_bytes,
                                  const std::vector<std::vector<int32_t>>& members,
                                  uint64_t& union_bytes) {
  std::vector<uint64_t> points;
  for (const GroupNeed& n : needs) {
    points.push_back(n.need.cell_begin);
    points.push_back(n.need.cell_end);
  }
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  const uint64_t chunk_bytes = needs.front().need.chunk_bytes;
  auto byte_of = [&](uint64_t cell) { return std::min(cell * cell_bytes, chunk_bytes); };
  std::vector<NeedRange> ranges;
  size_t first_open = 0;  // needs before it end at or before the current point
  for (size_t p = 0; p + 1 < points.size(); ++p) {
    const uint64_t b = points[p], e = points[p + 1];
    NeedRange range{b, e, {}, 0};
    bool any_full = false;
    unsigned __int128 needed = 0;
    while (first_open < needs.size() && needs[first_open].need.cell_end <= b) ++first_open;
    for (size_t i = first_open; i < needs.size() && needs[i].need.cell_begin < e; ++i) {
      const CellNeed& n = needs[i].need;
      if (n.cell_end <= b) continue;
      range.groups.push_back(needs[i].group);
      const uint64_t span = CellBytesOf(n, cell_bytes);
      any_full = any_full || n.needed_bytes == span;
      if (span > 0) {
        needed += static_cast<unsigned __int128>(n.needed_bytes) * (byte_of(e) - byte_of(b)) / span;
      }
    }
    if (range.groups.empty()) continue;
    std::sort(range.groups.begin(), range.groups.end());
    range.groups.erase(std::unique(range.groups.begin(), range.groups.end()), range.groups.end());
    for (int32_t g : range.groups) range.num_ranks += members[g].size();
    range.bytes = byte_of(e) - byte_of(b);
    range.needed = any_full
                       ? range.bytes
                       : static_cast<uint64_t>(std::min<unsigned __int128>(needed, range.bytes));
    union_bytes += range.needed;
    ranges.push_back(std::move(range));
  }
  return ranges;
}

// Checks one group's list: sorted, disjoint, inside its chunks, of known check kinds.
Status CheckList(std::span<const CellNeed> list, uint64_t cell_bytes, size_t group) {
  for (size_t i = 0; i < list.size(); ++i) {
    const CellNeed& n = list[i];
    const uint64_t cells = (n.chunk_bytes + cell_bytes - 1) / cell_bytes;
    std::string problem;
    if (n.cell_begin >= n.cell_end || n.cell_end > std::max<uint64_t>(cells, 1)) {
      problem = "cells [" + std::to_string(n.cell_begin) + ", " + std::to_string(n.cell_end) +
                ") outside a chunk of " + std::to_string(n.chunk_bytes) + " bytes";
    } else if (static_cast<uint8_t>(n.check) > 3) {
      problem = "unknown check kind " + std::to_string(static_cast<int>(n.check));
    } else if (n.needed_bytes > CellBytesOf(n, cell_bytes) ||
               (n.needed_bytes == 0 && n.chunk_bytes > 0)) {
      problem = std::to_string(n.needed_bytes) + " bytes needed in " +
                std::to_string(CellBytesOf(n, cell_bytes)) + " bytes of cells";
    } else if (i > 0) {
      const CellNeed& p = list[i - 1];
      const bool same_chunk = p.tensor == n.tensor && p.chunk == n.chunk;
      if (std::tie(p.tensor, p.chunk) > std::tie(n.tensor, n.chunk) ||
          (same_chunk && p.cell_end > n.cell_begin)) {
        problem = "not sorted and disjoint";
      }
    }
    if (!problem.empty()) {
      return DataLoss("read plan: the need list of rank group " + std::to_string(group) +
                      ", entry " + std::to_string(i) + " (tensor " + std::to_string(n.tensor) +
                      " chunk " + std::to_string(n.chunk) + "): " + problem);
    }
  }
  return Status::Ok();
}

}  // namespace

void CoalesceNeeds(std::vector<CellNeed>& needs, uint64_t cell_bytes) {
  std::sort(needs.begin(), needs.end(), [](const CellNeed& a, const CellNeed& b) {
    return std::tie(a.tensor, a.chunk, a.cell_begin, a.cell_end) <
           std::tie(b.tensor, b.chunk, b.cell_begin, b.cell_end);
  });
  auto full = [&](const CellNeed& n) { return n.needed_bytes == CellBytesOf(n, cell_bytes); };
  size_t out = 0;
  for (size_t i = 0; i < needs.size(); ++i) {
    const CellNeed& n = needs[i];
    if (out > 0) {
      CellNeed& last = needs[out - 1];
      const bool same_chunk = last.tensor == n.tensor && last.chunk == n.chunk;
      // Parts of one cell add up.
      if (same_chunk && last.cell_begin == n.cell_begin && last.cell_end == n.cell_end &&
          n.cell_end == n.cell_begin + 1) {
        last.needed_bytes += n.needed_bytes;
        continue;
      }
    }
    needs[out++] = n;
  }
  needs.resize(out);
  // Runs of wholly needed cells join.
  out = 0;
  for (size_t i = 0; i < needs.size(); ++i) {
    const CellNeed& n = needs[i];
    if (out > 0) {
      CellNeed& last = needs[out - 1];
      if (last.tensor == n.tensor && last.chunk == n.chunk && full(last) && full(n) &&
          n.cell_begin == last.cell_end) {
        last.needed_bytes += n.needed_bytes;
        last.cell_end = n.cell_end;
        continue;
      }
    }
    needs[out++] = n;
  }
  needs.resize(out);
}

void NeedsOfRun(uint32_t tensor, uint32_t chunk, uint64_t chunk_bytes, uint64_t offset,
                uint64_t length, CellCheck check, uint64_t cell_bytes,
                std::vector<CellNeed>& needs) {
  if (length == 0) return;
  const uint64_t end = offset + length;
  const uint64_t first = offset / cell_bytes, last = (end - 1) / cell_bytes;
  auto add = [&](uint64_t b, uint64_t e, uint64_t bytes) {
    if (b < e && bytes > 0) needs.push_back({tensor, chunk, chunk_bytes, b, e, bytes, check});
  };
  if (first == last) {
    add(first, first + 1, length);
    return;
  }
  add(first, first + 1, (first + 1) * cell_bytes - offset);
  add(first + 1, last, (last - first - 1) * cell_bytes);
  add(last, last + 1, end - last * cell_bytes);
}

Bytes EncodeNeeds(std::span<const CellNeed> needs) {
  Bytes out;
  out.reserve(4 + needs.size() * kEncodedNeedBytes);
  ByteWriter w(&out);
  w.Put<uint32_t>(static_cast<uint32_t>(needs.size()));
  for (const CellNeed& n : needs) {
    w.Put<uint32_t>(n.tensor);
    w.Put<uint32_t>(n.chunk);
    w.Put<uint64_t>(n.chunk_bytes);
    w.Put<uint64_t>(n.cell_begin);
    w.Put<uint64_t>(n.cell_end);
    w.Put<uint64_t>(n.needed_bytes);
    w.Put<uint8_t>(static_cast<uint8_t>(n.check));
  }
  return out;
}

Result<std::vector<CellNeed>> DecodeNeeds(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  uint32_t count = 0;
  TESSERA_RETURN_IF_ERROR(r.Get(&count));
  if (count > bytes.size() / kEncodedNeedBytes) {
    return DataLoss("read plan: need list of " + std::to_string(bytes.size()) + " bytes claims " +
                    std::to_string(count) + " entries");
  }
  std::vector<CellNeed> needs(count);
  for (CellNeed& n : needs) {
    uint8_t check = 0;
    TESSERA_RETURN_IF_ERROR(r.Get(&n.tensor));
    TESSERA_RETURN_IF_ERROR(r.Get(&n.chunk));
    TESSERA_RETURN_IF_ERROR(r.Get(&n.chunk_bytes));
    TESSERA_RETURN_IF_ERROR(r.Get(&n.cell_begin));
    TESSERA_RETURN_IF_ERROR(r.Get(&n.cell_end));
    TESSERA_RETURN_IF_ERROR(r.Get(&n.needed_bytes));
    TESSERA_RETURN_IF_ERROR(r.Get(&check));
    n.check = static_cast<CellCheck>(check);
  }
  if (r.position() != bytes.size()) {
    return DataLoss("read plan: need list has " + std::to_string(bytes.size() - r.position()) +
                    " trailing bytes");
  }
  return needs;
}

std::vector<int32_t> JobReadPlan::Receivers(const SharedPiece& piece) const {
  std::vector<int32_t> out;
  for (uint32_t h = piece.holders_begin; h < piece.holders_end; ++h) {
    for (int32_t r : members[holder_groups[h]]) {
      if (r != piece.reader) out.push_back(r);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

size_t JobReadPlan::NumReceivers(const SharedPiece& piece) const {
  size_t n = 0;
  bool reader_holds = false;
  for (uint32_t h = piece.holders_begin; h < piece.holders_end; ++h) {
    n += members[holder_groups[h]].size();
    reader_holds = reader_holds || holder_groups[h] == group_of[piece.reader];
  }
  return reader_holds ? n - 1 : n;
}

Result<JobReadPlan> PlanJobReads(std::span<const std::vector<CellNeed>> lists,
                                 std::span<const int32_t> group_of, uint64_t cell_bytes,
                                 uint64_t exchange_bytes) {
  if (cell_bytes == 0) return InvalidArgument("read plan: cell size 0");
  JobReadPlan plan;
  plan.cell_bytes = cell_bytes;
  plan.group_of.assign(group_of.begin(), group_of.end());
  plan.members.resize(lists.size());
  for (size_t r = 0; r < group_of.size(); ++r) {
    if (group_of[r] < 0 || static_cast<size_t>(group_of[r]) >= lists.size()) {
      return InvalidArgument("read plan: rank " + std::to_string(r) + " in group " +
                             std::to_string(group_of[r]) + " of " + std::to_string(lists.size()));
    }
    plan.members[group_of[r]].push_back(static_cast<int32_t>(r));
  }
  std::vector<GroupNeed> all;
  for (size_t g = 0; g < lists.size(); ++g) {
    TESSERA_RETURN_IF_ERROR(CheckList(lists[g], cell_bytes, g));
    if (plan.members[g].empty() && !lists[g].empty()) {
      return InvalidArgument("read plan: rank group " + std::to_string(g) + " has no ranks");
    }
    for (const CellNeed& n : lists[g]) {
      all.push_back({n, static_cast<int32_t>(g)});
      // Each rank alone reads whole checked cells, else exactly what it needs.
      plan.alone_read_bytes +=
          (n.check == CellCheck::kEachCell ? CellBytesOf(n, cell_bytes) : n.needed_bytes) *
          plan.members[g].size();
    }
  }
  std::sort(all.begin(), all.end(), [](const GroupNeed& a, const GroupNeed& b) {
    return std::tie(a.need.tensor, a.need.chunk, a.need.cell_begin, a.group) <
           std::tie(b.need.tensor, b.need.chunk, b.need.cell_begin, b.group);
  });
  const uint64_t piece_cells =
      std::max<uint64_t>(1, std::min(kMaxPieceBytes, exchange_bytes) / cell_bytes);
  std::vector<Task> tasks;
  for (size_t begin = 0; begin < all.size();) {
    size_t end = begin;
    const CellNeed& first = all[begin].need;
    while (end < all.size() && all[end].need.tensor == first.tensor &&
           all[end].need.chunk == first.chunk) {
      const CellNeed& n = all[end].need;
      if (n.chunk_bytes != first.chunk_bytes || n.check != first.check) {
        return DataLoss("read plan: rank groups " + std::to_string(all[begin].group) + " and " +
                        std::to_string(all[end].group) + " disagree on tensor " +
                        std::to_string(first.tensor) + " chunk " + std::to_string(first.chunk) +
                        " (length or checksum kind)");
      }
      ++end;
    }
    std::vector<NeedRange> ranges = SweepChunk(std::span(all).subspan(begin, end - begin),
                                               cell_bytes, plan.members, plan.union_needed_bytes);
    begin = end;
    // The chunk's holders, and whether one rank reads it whole for its one checksum.
    std::vector<int32_t> chunk_groups;
    for (const NeedRange& r : ranges) {
      chunk_groups.insert(chunk_groups.end(), r.groups.begin(), r.groups.end());
    }
    std::sort(chunk_groups.begin(), chunk_groups.end());
    chunk_groups.erase(std::unique(chunk_groups.begin(), chunk_groups.end()), chunk_groups.end());
    uint64_t chunk_ranks = 0;
    for (int32_t g : chunk_groups) chunk_ranks += plan.members[g].size();
    const bool cells = first.check == CellCheck::kEachCell;
    if (chunk_ranks < 2) {  // read by its one rank alone
      for (const NeedRange& r : ranges) plan.once_read_bytes += cells ? r.bytes : r.needed;
      continue;
    }
    const uint64_t num_cells =
        std::max<uint64_t>(1, (first.chunk_bytes + cell_bytes - 1) / cell_bytes);
    uint64_t covered = 0;
    for (const NeedRange& r : ranges) covered += r.cell_end - r.cell_begin;
    const bool whole = first.check == CellCheck::kWholeChunkAlways ||
                       (first.check == CellCheck::kWholeChunk && covered == num_cells);
    if (whole) {  // the gaps too, needed by no rank
      std::vector<NeedRange> filled;
      uint64_t at = 0;
      for (NeedRange& r : ranges) {
        if (r.cell_begin > at) filled.push_back({at, r.cell_begin, {}, 0});
        at = r.cell_end;
        filled.push_back(std::move(r));
      }
      if (at < num_cells) filled.push_back({at, num_cells, {}, 0});
      ranges = std::move(filled);
      plan.once_read_bytes += first.chunk_bytes;
    } else {  // shared ranges whole, the others as their one rank reads them
      for (const NeedRange& r : ranges) {
        plan.once_read_bytes += cells || r.num_ranks >= 2 ? r.bytes : r.needed;
      }
    }
    const CellCheck check = whole                                 ? CellCheck::kWholeChunk
                            : first.check == CellCheck::kEachCell ? CellCheck::kEachCell
                                                                  : CellCheck::kNone;
    const uint32_t chunk_first_piece = static_cast<uint32_t>(plan.pieces.size());
    for (const NeedRange& r : ranges) {
      if (!whole && r.num_ranks < 2) continue;
      const uint32_t holders_begin = static_cast<uint32_t>(plan.holder_groups.size());
      plan.holder_groups.insert(plan.holder_groups.end(), r.groups.begin(), r.groups.end());
      for (uint64_t c = r.cell_begin; c < r.cell_end; c += piece_cells) {
        SharedPiece piece;
        piece.tensor = first.tensor;
        piece.chunk = first.chunk;
        piece.begin = std::min(c * cell_bytes, first.chunk_bytes);
        piece.end = std::min(std::min(c + piece_cells, r.cell_end) * cell_bytes, first.chunk_bytes);
        piece.holders_begin = holders_begin;
        piece.holders_end = static_cast<uint32_t>(plan.holder_groups.size());
        piece.check = check;
        plan.pieces.push_back(piece);
        if (!whole) {
          const uint32_t i = static_cast<uint32_t>(plan.pieces.size());
          tasks.push_back({i - 1, i, piece.end - piece.begin, r.num_ranks, r.groups});
        }
      }
    }
    if (whole) {
      tasks.push_back({chunk_first_piece, static_cast<uint32_t>(plan.pieces.size()),
                       first.chunk_bytes, chunk_ranks, chunk_groups});
    }
  }
  // Readers: fewest holders first, larger first, each to the least-loaded rank that needs it.
  // A rank is in one group, so each group's ranks sit in one ordered set by (load, rank).
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    if (a.num_holders != b.num_holders) return a.num_holders < b.num_holders;
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    return a.first < b.first;
  });
  std::vector<std::set<std::pair<uint64_t, int32_t>>> by_load(plan.members.size());
  std::vector<uint64_t> load(group_of.size(), 0);
  for (size_t g = 0; g < plan.members.size(); ++g) {
    for (int32_t r : plan.members[g]) by_load[g].insert({0, r});
  }
  for (const Task& task : tasks) {
    std::pair<uint64_t, int32_t> best{UINT64_MAX, INT32_MAX};
    for (int32_t g : task.candidates) best = std::min(best, *by_load[g].begin());
    const int32_t reader = best.second;
    std::set<std::pair<uint64_t, int32_t>>& set = by_load[group_of[reader]];
    set.erase(set.begin());
    load[reader] += task.bytes;
    set.insert({load[reader], reader});
    for (uint32_t p = task.first; p < task.last; ++p) plan.pieces[p].reader = reader;
  }
  // Rounds: each reader's pieces in plan order, at most exchange_bytes of memory a round.
  std::vector<uint32_t> round(group_of.size(), 0);
  std::vector<uint64_t> used(group_of.size(), 0);
  for (SharedPiece& piece : plan.pieces) {
    const uint64_t cost = (piece.end - piece.begin) * (1 + plan.NumReceivers(piece));
    uint64_t& u = used[piece.reader];
    if (u > 0 && u + cost > exchange_bytes) {
      ++round[piece.reader];
      u = 0;
    }
    u += cost;
    plan.exchanged_bytes += (piece.end - piece.begin) * plan.NumReceivers(piece);
    piece.round = round[piece.reader];
    plan.num_rounds = std::max(plan.num_rounds, piece.round + 1);
  }
  return plan;
}

}  // namespace tessera
