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
#include "tessera/checkpoint.h"
#include "tessera/comm.h"
#include "tessera/storage.h"

namespace tessera {

// Names and headers of the plan's output files (parallel to ConvertPlan::files).
struct OutputLayout {
  std::vector<std::string> names;
  std::vector<Bytes> headers;  // the bytes before each file's data section
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
  uint64_t bytes_written = 0;  // data bytes
  uint64_t bytes_read = 0;     // from the source
  int files_written = 0;
};

// Creates (exclusively) every file of `plan` whose rank is `rank` in `dir`, writes its header,
// then its units and objects, loading them from the source checkpoint `index` (at `source`,
// for messages). Syncs (kFull) and closes the files. On failure returns the first error,
// naming the output file or the source key; the files stay for the caller to remove.
Result<RankWriteResult> WriteRankFiles(Storage& storage, const std::string& dir,
                                       const CheckpointIndex& index, const std::string& source,
                                       const ConvertPlan& plan, const OutputLayout& layout,
                                       int rank, const RankWriteOptions& options);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_CONVERT_WRITER_H_
