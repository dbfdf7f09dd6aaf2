// One rank's part of a conversion (tessera convert): writing the output files the plan gives
// it, unit by unit, on several threads. The protocol around it is in convert.cc.
#ifndef TESSERA_CHECKPOINT_CONVERT_WRITER_H_
#define TESSERA_CHECKPOINT_CONVERT_WRITER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "format/checkpoint_index.h"
#include "plan/convert_plan.h"
#include "tessera/bytes.h"
#include "tessera/checkpoint.h"
#include "tessera/storage.h"

namespace tessera {

// Where a tensor of a torch_dist output lies: one torch.save item (format/torch_dist/
// torch_zip.h) of the whole tensor, [prefix][data][suffix].
struct DcpTensorPlace {
  uint64_t item_offset = 0;  // in its file
  uint64_t data_offset = 0;  // in its file: item_offset + the prefix's size
  uint64_t item_length = 0;  // prefix + data + suffix
};

// Names and headers of the plan's output files (parallel to ConvertPlan::files).
struct OutputLayout {
  std::vector<std::string> names;
  std::vector<Bytes> headers;  // the bytes before each file's data section (none for DCP)
  // torch_dist only (empty otherwise): each plan tensor's item, and where each file's objects
  // begin (after its tensors' items; each object becomes a byte item whose length is known
  // once written, so a file's objects are written one after the other by one thread).
  std::vector<DcpTensorPlace> dcp_tensors;
  std::vector<uint64_t> dcp_objects_begin;
  bool dcp() const { return !dcp_objects_begin.empty(); }
};

struct RankWriteOptions {
  int num_threads = 4;
  uint64_t unit_bytes = 64u << 20;  // see PlanUnits
  // Checksum block of the output's tensors (tessera's kChecksumBlockBytes); 0: no checksums
  // are computed (Hugging Face files have none).
  uint64_t checksum_block_bytes = 0;
  SyncPolicy sync = SyncPolicy::kFull;
  bool verify_checksums = true;  // of the source
  // (bytes written, bytes to write), from the calling thread only.
  std::function<void(uint64_t, uint64_t)> progress;
};

struct RankWriteResult {
  // With checksums: for each file this rank writes (in plan order), the checksums of each of
  // its tensors' blocks (NumChecksumBlocks of them; one for a tensor without bytes), then one
  // per object.
  std::vector<uint64_t> checksums;
  // DCP: for each file this rank writes (in plan order), the length of each object's item.
  std::vector<uint64_t> object_lengths;
  uint64_t bytes_written = 0;  // data bytes
  uint64_t bytes_read = 0;     // from the source
  int files_written = 0;
};

// Creates (exclusively) every file of `plan` whose rank is `rank` in `dir` of `output`
// (the source is read from `storage`), writes its header,
// then its units and objects, loading them from the source checkpoint `index` (at `source`,
// for messages). With a DCP layout (layout.dcp()), writes each tensor's item prefix first,
// its data unit by unit (the zip CRC-32 of each 256 KiB block computed as it is written, on
// whichever thread writes it, then combined), its suffix last; and each file's objects as byte
// items (WriteDcpObjectItem) back to back; options.checksum_block_bytes is then ignored.
// Pieces of a Hugging Face output whose bytes are runs of source chunks (row splits, whole
// tensors) go straight from source file to output file, checked on the way (convert_copy.h);
// the others are loaded unit by unit through the buffer. Syncs (kFull) and closes the files. On
// failure returns the first error, naming the output file or the source key; the files stay for the
// caller to remove.
Result<RankWriteResult> WriteRankFiles(Storage& storage, Storage& output, const std::string& dir,
                                       const CheckpointIndex& index, const std::string& source,
                                       const ConvertPlan& plan, const OutputLayout& layout,
                                       int rank, const RankWriteOptions& options);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_CONVERT_WRITER_H_
