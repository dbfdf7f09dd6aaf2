// Writing Hugging Face safetensors checkpoints (tessera convert --to safetensors): the names of
// the files and the index JSON that maps every tensor to its file. The files themselves are
// plain safetensors files (format/safetensors.h).
#ifndef TESSERA_FORMAT_HUGGINGFACE_HF_EXPORT_H_
#define TESSERA_FORMAT_HUGGINGFACE_HF_EXPORT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/status.h"

namespace tessera {

// The one file of an unsharded checkpoint.
inline constexpr char kHuggingFaceSingleFileName[] = "model.safetensors";

// "model-00001-of-00003.safetensors" for shard 0 of 3 (`index` counts from 0), the names
// transformers' save_pretrained gives (five digits, more when there are more shards).
std::string HuggingFaceShardName(int index, int count);

// model.safetensors.index.json: {"metadata": {"total_size": N}, "weight_map": {name: file}},
// keys sorted, indented by 2, ending in a newline (as transformers writes it). `total_size`
// is the bytes of every tensor's data. InvalidArgument when a name is not valid UTF-8.
Result<std::string> EncodeHuggingFaceIndex(
    uint64_t total_size, const std::vector<std::pair<std::string, std::string>>& weight_map);

}  // namespace tessera

#endif  // TESSERA_FORMAT_HUGGINGFACE_HF_EXPORT_H_
