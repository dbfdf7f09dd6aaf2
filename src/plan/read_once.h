// The job-wide read plan of LoadOptions::read_sharing = kReadOnce: every byte of the checkpoint
// that some rank needs is read from storage by exactly one rank, checked once, and sent to the
// other ranks that need it.
//
// The unit of the plan is the cell: a chunk is cut, from its first byte, into cells of
// `cell_bytes` (the checkpoint's checksum block size, or 256 KiB for formats without blocks),
// the last one shorter. A cell is what a verified load reads whole anyway, so giving each cell
// one reader removes the duplicate reads of blocks that several ranks touch (a column slice of
// a row-major chunk touches every block of it) without reading more than a rank would alone.
//
// Each rank describes what it needs as a list of CellNeeds, in chunk coordinates (tensor and
// chunk indices, bytes from the chunk's start), so the lists mean the same on every rank even
// where byte positions in files are resolved per rank (DCP's zip records). Ranks with the same
// list (data-parallel replicas) send it once between them (Load gathers one list per group of
// identical signatures), so the plan's input is one list per group, and every rank computes the
// same plan from the same bytes. Pure and deterministic: sorts with total orders, ties by rank.
#ifndef TESSERA_PLAN_READ_ONCE_H_
#define TESSERA_PLAN_READ_ONCE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "tessera/bytes.h"
#include "tessera/status.h"

namespace tessera {

// The largest piece one reader is given at a time, by default: small enough to balance the reads
// of a few large chunks across ranks, large enough that a piece costs one storage request per
// 8 MiB. Loads from a store whose requests cost more than their bytes (S3: the storage's
// coalesce_read_bytes) pass a larger one.
inline constexpr uint64_t kDefaultMaxPieceBytes = 8ull << 20;

// How the cells of a chunk are checked when read.
enum class CellCheck : uint8_t {
  kNone = 0,              // not checked (no checksums, or verification off)
  kEachCell = 1,          // every cell is a checksum block of its own
  kWholeChunk = 2,        // one checksum for the whole chunk: checked when the job needs all of it
  kWholeChunkAlways = 3,  // the same, and read whole even if the job needs part of it
                          // (LoadOptions::verify_partial_chunks)
};

// What one rank needs of one chunk: cells [cell_begin, cell_end), of which `needed_bytes` bytes
// (its runs' bytes, for the report's union of needed bytes).
struct CellNeed {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  uint64_t chunk_bytes = 0;  // the chunk's length (the last cell ends there)
  uint64_t cell_begin = 0;
  uint64_t cell_end = 0;
  uint64_t needed_bytes = 0;
  CellCheck check = CellCheck::kNone;
};

// Sorts `needs` by (tensor, chunk, cells) and merges what is the same for the plan: the parts
// of one cell (their needed bytes add up: a rank's runs never overlap) and runs of wholly needed
// cells. A cell needed in part stays an entry of its own, so the union of several ranks' needs
// is exact where their parts of a cell are disjoint. Build the input with one entry per
// partly needed cell at each end of a run and one for the cells between (NeedsOfRun).
void CoalesceNeeds(std::vector<CellNeed>& needs, uint64_t cell_bytes);

// Appends the needs of `length` bytes at `offset` from the start of a chunk of `chunk_bytes`.
void NeedsOfRun(uint32_t tensor, uint32_t chunk, uint64_t chunk_bytes, uint64_t offset,
                uint64_t length, CellCheck check, uint64_t cell_bytes,
                std::vector<CellNeed>& needs);

Bytes EncodeNeeds(std::span<const CellNeed> needs);
// Bounded by the input: a count larger than the bytes can hold is an error, never an
// allocation.
Result<std::vector<CellNeed>> DecodeNeeds(std::span<const uint8_t> bytes);

// A byte range of a chunk read by one rank and sent to the other ranks that need it.
struct SharedPiece {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  uint64_t begin = 0;  // bytes from the chunk's start, at a cell boundary
  uint64_t end = 0;    // at a cell boundary or the chunk's end
  int32_t reader = 0;
  uint32_t round = 0;  // of the exchange
  // The groups whose ranks need the piece: JobReadPlan::holder_groups[holders_begin,
  // holders_end), ascending. Receivers are their members but the reader.
  uint32_t holders_begin = 0;
  uint32_t holders_end = 0;
  // kEachCell: the reader checks each cell; kWholeChunk: the piece is part of a chunk the reader
  // reads whole, in order, checking its one checksum at the chunk's last piece; kNone: not
  // checked.
  CellCheck check = CellCheck::kNone;
};

struct JobReadPlan {
  uint64_t cell_bytes = 0;
  std::vector<int32_t> group_of;              // per rank
  std::vector<std::vector<int32_t>> members;  // per group, ascending
  // Sorted by (tensor, chunk, begin); ranges needed by one rank only are not listed (that rank
  // reads them itself) unless they belong to a chunk read whole by another rank.
  std::vector<SharedPiece> pieces;
  std::vector<int32_t> holder_groups;
  uint32_t num_rounds = 0;
  // For the report: the bytes of the checkpoint the job needs, the union of every rank's
  // needs. Exact where ranks that need parts of one cell need the same parts (replicas, which
  // share a list) or disjoint ones (tensor-parallel slices); where the parts of different lists
  // overlap within a cell it counts them apart, never more than the cell.
  uint64_t union_needed_bytes = 0;
  // What the job reads from storage following the plan (the pieces once, and what ranks read
  // alone), what it would read with every rank reading for itself (LoadOptions::read_sharing
  // kNone: whole checked cells, else the bytes needed), and the bytes the plan sends between
  // ranks. LoadOptions' kAuto weighs them.
  uint64_t once_read_bytes = 0;
  uint64_t alone_read_bytes = 0;
  uint64_t exchanged_bytes = 0;

  // Ranks that need `piece` but the reader, ascending.
  std::vector<int32_t> Receivers(const SharedPiece& piece) const;
  size_t NumReceivers(const SharedPiece& piece) const;
};

// The plan for the groups' lists (`lists[g]` is what every member of group g needs; `group_of`
// maps ranks to groups, members ascending by rank). Each shared range is cut into pieces of at
// most min(max_piece_bytes, exchange_bytes / (1 + receivers)) (whole cells, at least one: a piece's
// reader holds it once and once per receiver) and given to the least-loaded (in
// bytes read) rank that needs it, pieces needed by fewer ranks first, larger first, ties by
// position and rank; a chunk read whole for its checksum goes whole to one rank that needs some
// of it. Each reader's pieces are then cut into rounds, in plan order, of at most
// `exchange_bytes` of memory counting the piece once read and once per receiver (a piece of one
// cell larger than that has a round of its own). Errors name the group of a list that contradicts
// another (a chunk of two lengths or check kinds).
Result<JobReadPlan> PlanJobReads(std::span<const std::vector<CellNeed>> lists,
                                 std::span<const int32_t> group_of, uint64_t cell_bytes,
                                 uint64_t exchange_bytes,
                                 uint64_t max_piece_bytes = kDefaultMaxPieceBytes);
// The same from the lists' encodings (EncodeNeeds), decoded one entry at a time as the plan
// sweeps the chunks in order: the plan then holds the encoded lists and its pieces, never every
// list decoded (16,384 ranks with distributed-optimizer ranges have as many distinct lists).
// A list that does not decode is an error naming its group.
Result<JobReadPlan> PlanJobReadsEncoded(std::span<const std::span<const uint8_t>> lists,
                                        std::span<const int32_t> group_of, uint64_t cell_bytes,
                                        uint64_t exchange_bytes,
                                        uint64_t max_piece_bytes = kDefaultMaxPieceBytes);

}  // namespace tessera

#endif  // TESSERA_PLAN_READ_ONCE_H_
