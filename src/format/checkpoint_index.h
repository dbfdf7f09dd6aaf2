// Reading the index of a checkpoint of any format: the format is detected from the files, so a
// user never names it. Each format is a codec (src/format/<name>/) that turns its index into
// the same Metadata; planning and loading never learn which format they serve.
#ifndef TESSERA_FORMAT_CHECKPOINT_INDEX_H_
#define TESSERA_FORMAT_CHECKPOINT_INDEX_H_

#include <memory>
#include <string>

#include "format/data_file_headers.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

struct CheckpointIndex {
  std::string root;  // the directory Metadata::files are relative to
  Metadata metadata;
  // The checkpoint is a rank-local save: the merge of its rank manifests (Finalize writes it
  // as one manifest). metadata.commit_seq is then its reference's number.
  bool rank_local = false;
  // The data files' safetensors headers, read by the loads of this index as they need them
  // (HasSafetensorsDataFiles), shared by its copies.
  std::shared_ptr<DataFileHeaders> headers = std::make_shared<DataFileHeaders>();
};

// Detects the format of `path` through the registry (format/registry.h: ChooseFormats,
// FormatOfFile) and reads its index. With the formats registered today:
//   - a tessera directory (docs/FORMAT.md, section 4): the highest numbered commit
//     "tessera.manifest.<n>" that is loadable (a whole manifest; or a reference to a rank-local
//     save whose every rank manifest is there, merged), else what a version 2 directory holds
//     (tessera.manifest as commit 0 and the rank-local saves of version 2, newest by save
//     time); with none, an error naming the ranks whose manifests the newest rank-local save
//     lacks (at most 16 of them, then a count). metadata.commit_seq says which commit loaded;
//     a damaged newest commit is an error, never replaced silently by an older one;
//   - a directory holding .metadata: PyTorch DCP / Megatron-Core torch_dist;
//   - a directory holding model.safetensors.index.json or *.safetensors files (none of them a
//     tessera data file): Hugging Face safetensors;
//   - a path to one .safetensors file: that file alone.
// Errors: kNotFound when `path` does not exist; kFailedPrecondition ("holds no committed
// checkpoint") for a directory with none of these, or with the data files of a tessera save
// that never committed; the codec's errors (kDataLoss naming the file) for a bad index.
Result<CheckpointIndex> ReadCheckpointIndex(Storage& storage, const std::string& path);

}  // namespace tessera

#endif  // TESSERA_FORMAT_CHECKPOINT_INDEX_H_
