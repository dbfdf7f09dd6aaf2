#include "plan/read_once.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <set>
#include <string>
#include <utility>

#include "core/byte_io.h"

namespace tessera {
namespace {

// An encoded CellNeed: six LEB128 varints (tensor, chunk, chunk_bytes, cell_begin, cells,
// needed_bytes) and the check byte; at least 7 bytes. Varints because every rank receives every
// distinct list (16,384 ranks with distributed-optimizer ranges: 16,384 lists), and the numbers
// are small: about 7 bytes an entry there instead of 41 at fixed width. Written here (a few
// lines) rather than taken from protobuf, which tessera does not otherwise depend on.
constexpr size_t kMinEncodedNeedBytes = 7;

void PutVarint(Bytes& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<uint8_t>(value | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<uint8_t>(value));
}

// Reads a varint at `at` (advanced past it); an error when it runs past the end or 64 bits.
Status GetVarint(std::span<const uint8_t> bytes, size_t& at, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at >= bytes.size()) return DataLoss("read plan: need list ends inside a number");
    const uint8_t b = bytes[at++];
    if (shift == 63 && b > 1) break;
    *value |= static_cast<uint64_t>(b & 0x7F) << shift;
    if ((b & 0x80) == 0) return Status::Ok();
  }
  return DataLoss("read plan: need list holds a number of more than 64 bits");
}

// Decodes the entry at `at` (advanced past it).
Status GetNeed(std::span<const uint8_t> bytes, size_t& at, CellNeed& n) {
  uint64_t tensor = 0, chunk = 0, cells = 0;
  TESSERA_RETURN_IF_ERROR(GetVarint(bytes, at, &tensor));
  TESSERA_RETURN_IF_ERROR(GetVarint(bytes, at, &chunk));
  TESSERA_RETURN_IF_ERROR(GetVarint(bytes, at, &n.chunk_bytes));
  TESSERA_RETURN_IF_ERROR(GetVarint(bytes, at, &n.cell_begin));
  TESSERA_RETURN_IF_ERROR(GetVarint(bytes, at, &cells));
  TESSERA_RETURN_IF_ERROR(GetVarint(bytes, at, &n.needed_bytes));
  if (at >= bytes.size()) return DataLoss("read plan: need list ends inside an entry");
  if (tensor > UINT32_MAX || chunk > UINT32_MAX || cells > UINT64_MAX - n.cell_begin) {
    return DataLoss("read plan: need list entry out of range");
  }
  n.tensor = static_cast<uint32_t>(tensor);
  n.chunk = static_cast<uint32_t>(chunk);
  n.cell_end = n.cell_begin + cells;
  n.check = static_cast<CellCheck>(bytes[at++]);
  return Status::Ok();
}
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
  // The groups whose members may read it: [candidates_begin, candidates_end) of
  // JobReadPlan::holder_groups, or of the chunks' groups (`whole_chunk`, a chunk read whole).
  // Indices, not a copy: a piece needed by 256 replicas would otherwise carry 1 KiB.
  uint32_t candidates_begin, candidates_end;
  bool whole_chunk;
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
    // Cells that the same groups need, one after another, are one range: its pieces are then
    // as long as exchange_bytes allows (one storage request per 8 MiB), where ranges cut at
    // each need's cell boundary (one per row of a column slice) made pieces of one cell, dealt
    // out to the readers in turn, one request each.
    NeedRange* last = ranges.empty() ? nullptr : &ranges.back();
    if (last != nullptr && last->cell_end == b && last->groups == range.groups) {
      last->cell_end = e;
      last->bytes += range.bytes;
      last->needed += range.needed;
      continue;
    }
    ranges.push_back(std::move(range));
  }
  return ranges;
}

// The ranks of group `group` for a message: "rank 3", "ranks 3, 7 and 12", "ranks 3, 7, 12 and
// 253 more" (the plan's groups are numbered internally; users know ranks).
std::string RanksOf(std::span<const int32_t> group_of, size_t group) {
  constexpr size_t kShown = 3;
  std::vector<int32_t> ranks;
  size_t count = 0;
  for (size_t r = 0; r < group_of.size(); ++r) {
    if (static_cast<size_t>(group_of[r]) != group) continue;
    if (ranks.size() < kShown) ranks.push_back(static_cast<int32_t>(r));
    ++count;
  }
  if (count == 0) return "group " + std::to_string(group) + " (no rank)";
  std::string text = count == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    const bool last = i + 1 == ranks.size() && count == ranks.size();
    text += (i == 0 ? "" : last ? " and " : ", ") + std::to_string(ranks[i]);
  }
  if (count > ranks.size()) text += " and " + std::to_string(count - ranks.size()) + " more";
  return text;
}

// What is wrong with an entry of a list (`previous`: the entry before it, or null), "" when it
// lies inside its chunk, has a known check kind, and comes after the previous one, disjoint.
std::string ProblemOfEntry(const CellNeed& n, const CellNeed* previous, uint64_t cell_bytes) {
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
  } else if (previous != nullptr) {
    const CellNeed& p = *previous;
    const bool same_chunk = p.tensor == n.tensor && p.chunk == n.chunk;
    if (std::tie(p.tensor, p.chunk) > std::tie(n.tensor, n.chunk) ||
        (same_chunk && p.cell_end > n.cell_begin)) {
      problem = "not sorted and disjoint";
    }
  }
  return problem;
}

// One list's entries, one at a time: from a decoded list, or decoded from its bytes as they are
// needed (so that a plan over many ranks' unique lists never holds them all decoded).
class NeedCursor {
 public:
  static NeedCursor Of(std::span<const CellNeed> list) {
    NeedCursor c;
    c.list_ = list;
    c.remaining_ = list.size();
    return c;
  }
  static Result<NeedCursor> Encoded(std::span<const uint8_t> bytes) {
    NeedCursor c;
    c.encoded_ = true;
    c.bytes_ = bytes;
    ByteReader r(bytes);
    uint32_t count = 0;
    TESSERA_RETURN_IF_ERROR(r.Get(&count));
    if (count > bytes.size() / kMinEncodedNeedBytes) {
      return DataLoss("read plan: need list of " + std::to_string(bytes.size()) + " bytes claims " +
                      std::to_string(count) + " entries");
    }
    c.remaining_ = count;
    c.position_ = 4;
    return c;
  }
  // The next entry into `out`; false at the end (an encoding with bytes left over: an error).
  Result<bool> Next(CellNeed& out) {
    if (remaining_ == 0) {
      if (encoded_ && position_ != bytes_.size()) {
        return DataLoss("read plan: need list has " + std::to_string(bytes_.size() - position_) +
                        " trailing bytes");
      }
      return false;
    }
    --remaining_;
    if (!encoded_) {
      out = list_[index_++];
      return true;
    }
    TESSERA_RETURN_IF_ERROR(GetNeed(bytes_, position_, out));
    return true;
  }

 private:
  bool encoded_ = false;
  std::span<const CellNeed> list_;
  size_t index_ = 0;
  std::span<const uint8_t> bytes_;
  size_t position_ = 0;
  size_t remaining_ = 0;
};

Result<JobReadPlan> PlanFromCursors(std::vector<NeedCursor>& cursors,
                                    std::span<const int32_t> group_of, uint64_t cell_bytes,
                                    uint64_t exchange_bytes, uint64_t max_piece_bytes);

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
  out.reserve(4 + needs.size() * 16);
  ByteWriter(&out).Put<uint32_t>(static_cast<uint32_t>(needs.size()));
  for (const CellNeed& n : needs) {
    PutVarint(out, n.tensor);
    PutVarint(out, n.chunk);
    PutVarint(out, n.chunk_bytes);
    PutVarint(out, n.cell_begin);
    PutVarint(out, n.cell_end - n.cell_begin);
    PutVarint(out, n.needed_bytes);
    out.push_back(static_cast<uint8_t>(n.check));
  }
  return out;
}

Result<std::vector<CellNeed>> DecodeNeeds(std::span<const uint8_t> bytes) {
  TESSERA_ASSIGN_OR_RETURN(NeedCursor cursor, NeedCursor::Encoded(bytes));
  std::vector<CellNeed> needs;
  for (CellNeed n;;) {
    TESSERA_ASSIGN_OR_RETURN(const bool got, cursor.Next(n));
    if (!got) return needs;
    needs.push_back(n);
  }
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
                                 uint64_t exchange_bytes, uint64_t max_piece_bytes) {
  std::vector<NeedCursor> cursors;
  for (const std::vector<CellNeed>& list : lists) cursors.push_back(NeedCursor::Of(list));
  return PlanFromCursors(cursors, group_of, cell_bytes, exchange_bytes, max_piece_bytes);
}

Result<JobReadPlan> PlanJobReadsEncoded(std::span<const std::span<const uint8_t>> lists,
                                        std::span<const int32_t> group_of, uint64_t cell_bytes,
                                        uint64_t exchange_bytes, uint64_t max_piece_bytes) {
  std::vector<NeedCursor> cursors;
  for (size_t g = 0; g < lists.size(); ++g) {
    Result<NeedCursor> cursor = NeedCursor::Encoded(lists[g]);
    if (!cursor.ok()) {
      return cursor.status().WithContext("the need list of " + RanksOf(group_of, g));
    }
    cursors.push_back(*cursor);
  }
  return PlanFromCursors(cursors, group_of, cell_bytes, exchange_bytes, max_piece_bytes);
}

namespace {

// Merges the groups' lists (each sorted by tensor and chunk) one chunk at a time: the needs of
// every group for the next chunk, sorted by (cell_begin, group). Checks each entry as it comes.
class ChunkMerger {
 public:
  ChunkMerger(std::vector<NeedCursor>& cursors, uint64_t cell_bytes, JobReadPlan& plan)
      : cursors_(cursors),
        cell_bytes_(cell_bytes),
        plan_(plan),
        head_(cursors.size()),
        count_(cursors.size(), 0) {}

  Status Start() {
    for (size_t g = 0; g < cursors_.size(); ++g) {
      TESSERA_ASSIGN_OR_RETURN(const bool got, Advance(g));
      if (got) heap_.push({head_[g].tensor, head_[g].chunk, static_cast<int32_t>(g)});
    }
    return Status::Ok();
  }
  // The next chunk's needs into `out`; false when every list is done.
  Result<bool> Next(std::vector<GroupNeed>& out) {
    out.clear();
    if (heap_.empty()) return false;
    const Key key = heap_.top();
    while (!heap_.empty() && heap_.top().tensor == key.tensor && heap_.top().chunk == key.chunk) {
      const int32_t g = heap_.top().group;
      heap_.pop();
      bool got = true;
      while (got && head_[g].tensor == key.tensor && head_[g].chunk == key.chunk) {
        out.push_back({head_[g], g});
        TESSERA_ASSIGN_OR_RETURN(got, Advance(g));
      }
      if (got) heap_.push({head_[g].tensor, head_[g].chunk, g});
    }
    std::sort(out.begin(), out.end(), [](const GroupNeed& a, const GroupNeed& b) {
      return std::tie(a.need.cell_begin, a.group) < std::tie(b.need.cell_begin, b.group);
    });
    return true;
  }

 private:
  struct Key {
    uint32_t tensor, chunk;
    int32_t group;
    bool operator>(const Key& o) const {
      return std::tie(tensor, chunk, group) > std::tie(o.tensor, o.chunk, o.group);
    }
  };
  // Moves group g's head to its next entry, checked; false at the end of its list.
  Result<bool> Advance(size_t g) {
    CellNeed n;
    Result<bool> got = cursors_[g].Next(n);
    if (!got.ok()) {
      return got.status().WithContext("the need list of " + RanksOf(plan_.group_of, g) +
                                      ", entry " + std::to_string(count_[g]));
    }
    if (!*got) return false;
    if (plan_.members[g].empty()) {
      return InvalidArgument("read plan: need list " + std::to_string(g) + " has no ranks");
    }
    const std::string problem = ProblemOfEntry(n, count_[g] > 0 ? &head_[g] : nullptr, cell_bytes_);
    if (!problem.empty()) {
      return DataLoss("read plan: the need list of " + RanksOf(plan_.group_of, g) + ", entry " +
                      std::to_string(count_[g]) + " (tensor " + std::to_string(n.tensor) +
                      " chunk " + std::to_string(n.chunk) + "): " + problem);
    }
    // Each rank alone reads whole checked cells, else exactly what it needs.
    plan_.alone_read_bytes +=
        (n.check == CellCheck::kEachCell ? CellBytesOf(n, cell_bytes_) : n.needed_bytes) *
        plan_.members[g].size();
    head_[g] = n;
    ++count_[g];
    return true;
  }

  std::vector<NeedCursor>& cursors_;
  const uint64_t cell_bytes_;
  JobReadPlan& plan_;
  std::vector<CellNeed> head_;
  std::vector<size_t> count_;
  std::priority_queue<Key, std::vector<Key>, std::greater<Key>> heap_;
};

Result<JobReadPlan> PlanFromCursors(std::vector<NeedCursor>& cursors,
                                    std::span<const int32_t> group_of, uint64_t cell_bytes,
                                    uint64_t exchange_bytes, uint64_t max_piece_bytes) {
  if (cell_bytes == 0) return InvalidArgument("read plan: cell size 0");
  JobReadPlan plan;
  plan.cell_bytes = cell_bytes;
  plan.group_of.assign(group_of.begin(), group_of.end());
  plan.members.resize(cursors.size());
  for (size_t r = 0; r < group_of.size(); ++r) {
    if (group_of[r] < 0 || static_cast<size_t>(group_of[r]) >= cursors.size()) {
      return InvalidArgument("read plan: rank " + std::to_string(r) + " in group " +
                             std::to_string(group_of[r]) + " of " + std::to_string(cursors.size()));
    }
    plan.members[group_of[r]].push_back(static_cast<int32_t>(r));
  }
  // A piece takes its bytes once read and once per receiver in its reader's round: at most
  // exchange_bytes / (1 + receivers), whole cells, at least one.
  auto piece_cells = [&](uint64_t copies) {
    return std::max<uint64_t>(1, std::min(max_piece_bytes, exchange_bytes / copies) / cell_bytes);
  };
  std::vector<Task> tasks;
  std::vector<int32_t> whole_chunk_groups;  // Task::whole_chunk's candidates
  ChunkMerger merger(cursors, cell_bytes, plan);
  TESSERA_RETURN_IF_ERROR(merger.Start());
  std::vector<GroupNeed> needs;  // of one chunk
  while (true) {
    TESSERA_ASSIGN_OR_RETURN(const bool more, merger.Next(needs));
    if (!more) break;
    const CellNeed first = needs.front().need;
    for (const GroupNeed& gn : needs) {
      if (gn.need.chunk_bytes != first.chunk_bytes || gn.need.check != first.check) {
        return DataLoss("read plan: " + RanksOf(group_of, needs.front().group) + " and " +
                        RanksOf(group_of, gn.group) + " disagree on tensor " +
                        std::to_string(first.tensor) + " chunk " + std::to_string(first.chunk) +
                        " (length or checksum kind)");
      }
    }
    std::vector<NeedRange> ranges =
        SweepChunk(needs, cell_bytes, plan.members, plan.union_needed_bytes);
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
      // Receivers: the range's ranks but the reader, or all of them where the reader of a
      // chunk read whole may need none of this range.
      const uint64_t cells_per_piece = piece_cells(whole ? 1 + r.num_ranks : r.num_ranks);
      for (uint64_t c = r.cell_begin; c < r.cell_end; c += cells_per_piece) {
        SharedPiece piece;
        piece.tensor = first.tensor;
        piece.chunk = first.chunk;
        piece.begin = std::min(c * cell_bytes, first.chunk_bytes);
        piece.end =
            std::min(std::min(c + cells_per_piece, r.cell_end) * cell_bytes, first.chunk_bytes);
        piece.holders_begin = holders_begin;
        piece.holders_end = static_cast<uint32_t>(plan.holder_groups.size());
        piece.check = check;
        plan.pieces.push_back(piece);
        if (!whole) {
          const uint32_t i = static_cast<uint32_t>(plan.pieces.size());
          tasks.push_back({i - 1, i, piece.end - piece.begin, r.num_ranks, piece.holders_begin,
                           piece.holders_end, false});
        }
      }
    }
    if (whole) {
      const uint32_t begin = static_cast<uint32_t>(whole_chunk_groups.size());
      whole_chunk_groups.insert(whole_chunk_groups.end(), chunk_groups.begin(), chunk_groups.end());
      tasks.push_back({chunk_first_piece, static_cast<uint32_t>(plan.pieces.size()),
                       first.chunk_bytes, chunk_ranks, begin,
                       static_cast<uint32_t>(whole_chunk_groups.size()), true});
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
    const std::vector<int32_t>& pool = task.whole_chunk ? whole_chunk_groups : plan.holder_groups;
    for (uint32_t c = task.candidates_begin; c < task.candidates_end; ++c) {
      best = std::min(best, *by_load[pool[c]].begin());
    }
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

}  // namespace

}  // namespace tessera
