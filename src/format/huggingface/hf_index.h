// Hugging Face safetensors checkpoints as tessera Metadata: one `model.safetensors`, shards
// `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`
// ({"metadata": {"total_size": N}, "weight_map": {name: file}}), a directory of *.safetensors
// files without an index, or one .safetensors file. Every tensor is one whole chunk, raw and
// row-major where its file says; there are no checksums (Metadata::checksum is kNone).
#ifndef TESSERA_FORMAT_HUGGINGFACE_HF_INDEX_H_
#define TESSERA_FORMAT_HUGGINGFACE_HF_INDEX_H_

#include <string>
#include <vector>

#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

inline constexpr char kHuggingFaceIndexName[] = "model.safetensors.index.json";

// Reads the index of the safetensors files in `dir` whose listing is `names`: those the index
// JSON names when there is one, else every *.safetensors file (a set of shards
// "<prefix>-<i>-of-<n>.safetensors" only when all n are there: DataLoss naming the missing one).
// Errors name the file: a header
// that is not valid, a dtype tessera does not know, a tensor in two files, an index naming a
// tensor its file lacks or a file that is missing.
Result<Metadata> ReadHuggingFaceDirectory(Storage& storage, const std::string& dir,
                                          const std::vector<std::string>& names);

// The index of the one safetensors file `dir`/`file_name`.
Result<Metadata> ReadHuggingFaceFile(Storage& storage, const std::string& dir,
                                     const std::string& file_name);

}  // namespace tessera

#endif  // TESSERA_FORMAT_HUGGINGFACE_HF_INDEX_H_
