// Load planning: which byte ranges of which files land where. Pure and deterministic.
//
// A destination is a box of a saved tensor and the memory that holds it row-major. For each
// saved chunk it intersects, the intersection becomes "runs": byte ranges contiguous both in
// the file and in the destination, so each run is one read straight into place. Nothing reads
// a whole chunk to use part of it.
#ifndef TESSERA_PLAN_LOAD_PLAN_H_
#define TESSERA_PLAN_LOAD_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/box.h"
#include "tessera/metadata.h"
#include "tessera/state_dict.h"
#include "tessera/status.h"

namespace tessera {

// Finds the chunks of a tensor that intersect a box without looking at every chunk: chunks are
// sorted by their offset along the dimension with the most distinct offsets, and a query scans
// only those that can reach the box along it.
class ChunkIndex {
 public:
  explicit ChunkIndex(const TensorInfo& tensor);
  // Calls fn(chunk index) for every chunk that shares an element with `box`, in ascending
  // chunk order.
  void ForEachIntersecting(const Box& box, const std::function<void(uint32_t)>& fn) const;

 private:
  const TensorInfo* tensor_;
  size_t dim_ = 0;
  int64_t max_extent_ = 0;
  std::vector<uint32_t> by_offset_;  // chunk indices sorted by offsets[dim_]
};

// A conversion of elements on load (LoadOptions::cast_dtypes): the saved dtype and the one
// the destination holds, both IsFloatDType (core/dtype_convert.h).
struct DTypeCast {
  DType from = DType::kF32;
  DType to = DType::kF32;
  friend bool operator==(const DTypeCast&, const DTypeCast&) = default;
};

// One read: `length` bytes at `file_offset` of file `file_index`, into `destination`.
struct ReadRun {
  uint32_t file_index = 0;
  uint64_t file_offset = 0;
  uint64_t length = 0;
  std::byte* destination = nullptr;
  uint32_t tensor = 0;  // index into Metadata::tensors (the reader checks its checksums)
  uint32_t chunk = 0;   // index into that tensor's chunks
  // For a flat range of a local box (a distributed optimizer's shard): such runs are not
  // shared between ranks (read sharing), data-parallel ranks never hold the same ones.
  bool flat = false;
  // Set when the destination holds another dtype: the reader converts the run's elements as
  // they arrive, and `destination` holds DestinationLength() bytes.
  std::optional<DTypeCast> cast;

  uint64_t DestinationLength() const {
    return cast ? length / DTypeSize(cast->from) * DTypeSize(cast->to) : length;
  }
};

// A part of a chunk stored in another dimension order than row-major (ChunkInfo::
// storage_order, e.g. a transposed view saved by torch): its run of elements along the stored
// innermost dimension is not contiguous in the destination, so the reader reads the chunk
// whole and copies the part element by element.
struct PermutedCopy {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  Box part;                          // in global coordinates, inside the chunk and the layout
  Box layout;                        // of the destination
  std::byte* destination = nullptr;  // holds `layout` row-major
  std::optional<DTypeCast> cast;     // the destination's dtype differs from the saved one
};

// Appends the runs that fill `box` (of metadata.tensors[tensor]) into `destination`, which holds
// `layout` row-major; `box` must lie inside `layout` (usually they are equal; a shape-mismatched
// load fills only part of its layout). Returns the number of elements of `box` covered by saved
// chunks (box.NumElements() when nothing is missing).
// Parts of chunks with a storage order become `permuted` copies instead of runs. With `cast`,
// `destination` holds elements of cast->to (the saved dtype is cast->from).
int64_t PlanTensorReads(const Metadata& metadata, uint32_t tensor, const ChunkIndex& index,
                        const Box& box, const Box& layout, std::byte* destination,
                        std::vector<ReadRun>& runs, std::vector<PermutedCopy>& permuted,
                        std::optional<DTypeCast> cast = std::nullopt);

// One object this rank asks for: read whole into `destination->data`.
struct ObjectRead {
  const ObjectInfo* info = nullptr;
  ShardedObject* destination = nullptr;
};

// Everything one rank reads on load.
struct RankReadPlan {
  std::vector<ReadRun> runs;  // coalesced, sorted by (file, offset)
  std::vector<PermutedCopy> permuted;
  std::vector<ObjectRead> objects;
  // asked[k] is 1 when this rank asks for key k: the manifest's tensors, then its objects.
  std::vector<int64_t> asked;
  std::vector<std::string> missing_keys;           // asked for, absent, skipped
  std::vector<std::string> shape_mismatched_keys;  // loaded in part (allow_shape_mismatch)
  uint64_t bytes_needed = 0;                       // of the destinations (in their dtypes)
};

// Plans the reads that fill every entry of `state` from the checkpoint `metadata` describes.
// Errors name the key and the box: dtype mismatch (unless `cast_dtypes` and both dtypes are
// floats, IsFloatDType: the runs then carry a DTypeCast), shape mismatch (unless
// allow_shape_mismatch), a requested box outside the saved tensor, a region no saved chunk
// covers, a missing key (unless `skip_missing`). `path` is used in messages only. Touches no
// tensor memory.
Result<RankReadPlan> PlanRankReads(const Metadata& metadata, StateDict& state,
                                   const std::string& path, bool skip_missing,
                                   bool cast_dtypes = false);

// Sorts runs by (file, offset) and merges runs of one chunk adjacent both in the file and in
// memory.
void CoalesceRuns(std::vector<ReadRun>& runs);

}  // namespace tessera

#endif  // TESSERA_PLAN_LOAD_PLAN_H_
