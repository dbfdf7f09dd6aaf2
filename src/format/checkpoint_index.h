// Reading the index of a checkpoint of any format: the format is detected from the files, so a
// user never names it. Each format is a codec (src/format/<name>/) that turns its index into
// the same Metadata; planning and loading never learn which format they serve.
#ifndef TESSERA_FORMAT_CHECKPOINT_INDEX_H_
#define TESSERA_FORMAT_CHECKPOINT_INDEX_H_

#include <memory>
#include <string>

#include "format/safetensors.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

struct CheckpointIndex {
  std::string root;  // the directory Metadata::files are relative to
  Metadata metadata;
  // The checkpoint is a rank-local save: the merge of its rank manifests (Finalize writes it
  // as one manifest).
  bool rank_local = false;
  // The data files' safetensors headers, read by the loads of this index as they need them
  // (HasSafetensorsDataFiles), shared by its copies.
  std::shared_ptr<DataFileHeaders> headers = std::make_shared<DataFileHeaders>();
};

// Detects the format of `path` and reads its index:
//   - a directory holding tessera.manifest and/or the rank manifests of rank-local saves: the
//     newest (by save time) of the committed manifest and the complete rank-local saves; with
//     neither, an error naming the ranks whose manifests a rank-local save lacks;
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
