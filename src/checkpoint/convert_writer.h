// One rank's part of a conversion (tessera convert): writing the output files the plan gives
// it, unit by unit, on several threads. The protocol around it is in convert.cc.
#ifndef TESSERA_CHECKPOINT_CONVERT_WRITER_H_
#define TESSERA_CHECKPOINT_CONVERT_WRITER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "format/checkpoint_index.h"
#include "plan/convert_plan.h"
#include "tessera/bytes.h"
#include "tessera/checkpoint.h"
#include "tessera/format_writer.h"
#include "tessera/storage.h"

namespace tessera {

// The output files of a conversion as its format lays them out (FormatWriter::NewDataFile),
// parallel to ConvertPlan::files. Each file's items are its tensors, then its objects, in plan
// order. Every rank computes the same layout.
struct OutputLayout {
  std::vector<std::string> names;  // as written (FilesAreTheCheckpoint: hidden until committed)
  std::vector<std::unique_ptr<DataFileEncoder>> files;
  // By plan tensor: its item's offset in its file, and where its data lies (PlaceItem).
  std::vector<uint64_t> tensor_offsets;
  std::vector<ItemPlacement> tensor_places;
  // By file: where the items of its objects begin (the end of its last tensor's item, or of
  // its header). Objects are written in order from there, by one thread (an object's item
  // length may be known only once written).
  std::vector<uint64_t> objects_begin;
  // What a writer computes per kChecksumBlockBytes block of each tensor's data: tessera's
  // checksums (FormatWriter::EngineChecksums) and the CRC-32 the framing records
  // (FormatWriter::FramingChecksum, for DataFileEncoder::WriteFraming).
  bool engine_checksums = false;
  bool framing_crc32 = false;
};

// Lays out `plan` (of the checkpoint `source`) as `writer` writes it for save `save_id`. Errors
// name the key the format cannot store, or whose item it cannot place.
Result<OutputLayout> LayOutOutput(const ConvertPlan& plan, const Metadata& source,
                                  const FormatWriter& writer, const std::string& save_id);

struct RankWriteOptions {
  int num_threads = 4;
  uint64_t unit_bytes = 64u << 20;  // see PlanUnits
  SyncPolicy sync = SyncPolicy::kFull;
  bool verify_checksums = true;  // of the source
  // (bytes written, bytes to write), from the calling thread only.
  std::function<void(uint64_t, uint64_t)> progress;
};

struct RankWriteResult {
  // With engine checksums: for each file this rank writes (in plan order), the checksums of
  // each of its tensors' blocks (NumChecksumBlocks of them; one for a tensor without bytes),
  // then one per object.
  std::vector<uint64_t> checksums;
  // For each file this rank writes (in plan order), the stored length of each object's item.
  std::vector<uint64_t> object_lengths;
  uint64_t bytes_written = 0;  // data bytes
  uint64_t bytes_read = 0;     // from the source
  int files_written = 0;
};

// Creates (exclusively) every file of `plan` whose rank is `rank` in `dir` of `output`
// (the source is read from `storage`), writes its header, then its units and objects, loading
// them from the source checkpoint `index` (at `source`, for messages), each piece of a tensor
// at its place in the file (OutputLayout::tensor_places), the checksums and CRC-32s the layout
// asks for computed block by block right after each block is written, on whichever thread
// writes it. Then each tensor's framing (DataFileEncoder::WriteFraming, with the CRC-32 of its
// data combined from its blocks'), and each file's objects in order through BeginItem. Pieces
// of an output without checksums whose bytes are runs of source chunks (row splits, whole
// tensors) go straight from source file to output file, checked on the way (convert_copy.h);
// the others are loaded unit by unit through the buffer. Syncs (kFull) and closes the files.
// On failure returns the first error, naming the output file or the source key; the files stay
// for the caller to remove.
Result<RankWriteResult> WriteRankFiles(Storage& storage, Storage& output, const std::string& dir,
                                       const CheckpointIndex& index, const std::string& source,
                                       const ConvertPlan& plan, const OutputLayout& layout,
                                       int rank, const RankWriteOptions& options);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_CONVERT_WRITER_H_
