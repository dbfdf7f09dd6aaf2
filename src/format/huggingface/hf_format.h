// Hugging Face safetensors as a Format: a directory of *.safetensors files (with or without
// model.safetensors.index.json), or one .safetensors file. It has no commit file: the data
// files alone are the checkpoint.
#ifndef TESSERA_FORMAT_HUGGINGFACE_HF_FORMAT_H_
#define TESSERA_FORMAT_HUGGINGFACE_HF_FORMAT_H_

#include "tessera/format.h"

namespace tessera {

// The codec the registry lists.
const Format& HuggingFaceFormat();

}  // namespace tessera

#endif  // TESSERA_FORMAT_HUGGINGFACE_HF_FORMAT_H_
