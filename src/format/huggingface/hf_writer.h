// The write side of Hugging Face safetensors, for conversions into it (tessera convert --to
// safetensors; a save never writes this format): "model.safetensors" alone, or shards named as
// transformers names them with model.safetensors.index.json mapping every tensor to its shard.
// Each file is a safetensors header naming its tensors, their bytes back to back after it. The
// files carry the checkpoint's own names (FormatWriter::FilesAreTheCheckpoint), hold tensors
// only and no checksums.
#ifndef TESSERA_FORMAT_HUGGINGFACE_HF_WRITER_H_
#define TESSERA_FORMAT_HUGGINGFACE_HF_WRITER_H_

#include <memory>

#include "tessera/format_writer.h"

namespace tessera {

std::unique_ptr<FormatWriter> NewHuggingFaceWriter();

}  // namespace tessera

#endif  // TESSERA_FORMAT_HUGGINGFACE_HF_WRITER_H_
