// Save planning: pure functions from each rank's holdings to who writes what.
//
//   BuildLocalPlan (every rank) -> EncodeLocalPlan -> gathered to the coordinator ->
//   BuildGlobalSavePlan (coordinator): validation, dedup, writer choice, manifest skeleton ->
//   each rank's write list -> writes -> FinishMetadata (coordinator) fills in the locations.
//
// No I/O, no communication, deterministic: the same inputs give the same plan.
#ifndef TESSERA_PLAN_SAVE_PLAN_H_
#define TESSERA_PLAN_SAVE_PLAN_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/tiling.h"
#include "tessera/box.h"
#include "tessera/bytes.h"
#include "tessera/dtype.h"
#include "tessera/metadata.h"
#include "tessera/sharded_tensor.h"
#include "tessera/state_dict.h"
#include "tessera/status.h"

namespace tessera {

// Numbers travel between ranks of one job only; not written to disk.
enum class ItemKind : uint8_t { kTensor = 0, kObject = 1 };

// One contiguous piece of bytes a rank holds: a box of a tensor, or a whole object.
struct LocalItem {
  std::string key;
  ItemKind kind = ItemKind::kTensor;
  DType dtype = DType::kU8;  // tensors
  bool partial = false;      // tensors: coverage check skipped
  Dims global_shape;         // tensors (inline: a plan of a million items copies no heap array)
  Box box;                   // tensors
  ReplicaId replica_id;
  uint64_t num_bytes = 0;
  ObjectEncoding object_encoding = ObjectEncoding::kBytes;  // objects
  // Where the bytes are on the owning rank; not encoded (meaningless elsewhere).
  uint32_t entry_index = 0;  // into the rank's StateDict::entries()
  uint64_t byte_offset = 0;  // into that entry's data
};

struct LocalPlan {
  std::vector<LocalItem> items;
};

// Validates every entry of `state` and lists its items (flat ranges become boxes). Several
// pieces of one key (StateDict takes them) are items of their own, each pointing at its entry's
// memory; pieces that overlap are an error (plan/local_pieces.h).
Result<LocalPlan> BuildLocalPlan(const StateDict& state);

// Compact binary encoding (what travels to the coordinator) and its inverse.
// Without replica ids (`with_replica_ids` false) the encoding holds what data-parallel
// replicas have in common (plan_exchange.h); decoded, every item is then the main replica.
Bytes EncodeLocalPlan(const LocalPlan& plan, bool with_replica_ids = true);
Result<LocalPlan> DecodeLocalPlan(std::span<const uint8_t> bytes, bool with_replica_ids = true);
// Decodes every rank's plan (entry r from rank r) with up to `threads` threads. Errors name the
// rank.
Result<std::vector<LocalPlan>> DecodeLocalPlans(std::span<const std::span<const uint8_t>> encoded,
                                                int threads);

struct SavePlanOptions {
  bool balance_writes = false;  // see SaveOptions::balance_writes
  // When the plans stand for groups of ranks (data-parallel replicas sending one plan for the
  // group, plan_exchange.h): the ranks plan i stands for, for error messages, and the number of
  // ranks of the job (Metadata::num_ranks). Default: plan i is rank i.
  std::function<std::vector<int32_t>(int32_t)> ranks_of;
  int32_t num_ranks = -1;
  // false for one rank's part of a rank-local save: its boxes need not cover a tensor (the
  // union of every rank's part is checked when the parts are read together).
  bool require_coverage = true;
  // Threads that check and build the keys' chunks (the plan does not depend on it). 0: as many
  // as the machine has, up to 8, one per 65,536 items.
  int threads = 0;
};

// Identifies one item on one rank.
struct ItemRef {
  int32_t rank = 0;
  uint32_t item = 0;  // index into that rank's LocalPlan::items
  friend bool operator==(const ItemRef&, const ItemRef&) = default;
};

struct GlobalSavePlan {
  // writes[r]: indices into rank r's LocalPlan::items that rank r writes, ascending.
  std::vector<std::vector<uint32_t>> writes;
  // Manifest content without locations: tensors and objects sorted by key, chunks sorted by
  // box. Files and locations are filled in by FinishMetadata.
  Metadata metadata;
  // writer_of_chunk[t][c]: the item that writes metadata.tensors[t].chunks[c].
  std::vector<std::vector<ItemRef>> chunk_writers;
  std::vector<ItemRef> object_writers;  // parallel to metadata.objects
  uint64_t total_bytes = 0;             // of everything written once
};

// Validates the union of all ranks' holdings and decides who writes what. Errors name the key,
// the boxes and the ranks: dtype or global shape disagreeing between ranks, a key that is a
// tensor on one rank and an object on another, boxes out of bounds, overlapping boxes,
// incomplete coverage (unless partial), a shard no main replica holds, an object key held as
// main replica by two ranks with different bytes sizes.
Result<GlobalSavePlan> BuildGlobalSavePlan(std::span<const LocalPlan> plans,
                                           const SavePlanOptions& options);

// Where one written item landed, reported by its writer.
struct WrittenItem {
  uint32_t item = 0;    // index into the writer's LocalPlan::items
  uint32_t file = 0;    // index into the writer's WriteResult::files
  uint64_t offset = 0;  // absolute, in the file
  uint64_t length = 0;
  uint64_t checksum = 0;  // of the first checksum block (ByteLocation::checksum)
  // The checksums of the item's later blocks (ChunkInfo::block_checksums) are
  // WriteResult::block_checksums[first_block, first_block + num_blocks).
  uint64_t num_blocks = 0;
  uint64_t first_block = 0;
};

struct WriteResult {
  std::vector<FileInfo> files;  // written by this rank
  std::vector<WrittenItem> items;
  std::vector<uint64_t> block_checksums;
};

Bytes EncodeWriteResult(const WriteResult& result);
Result<WriteResult> DecodeWriteResult(std::span<const uint8_t> bytes);

// Fills plan.metadata's file table and every location from the writers' results (indexed by
// rank). Fails naming the key when a planned item was not reported.
Result<Metadata> FinishMetadata(const GlobalSavePlan& plan, std::span<const WriteResult> results);

}  // namespace tessera

#endif  // TESSERA_PLAN_SAVE_PLAN_H_
