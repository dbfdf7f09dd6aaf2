// PyTorch DCP (torch.distributed.checkpoint) and Megatron-Core's torch_dist as a Format: a
// directory committed by its .metadata pickle, whose chunks and objects are torch.save zip
// archives (resolved lazily) or raw bytes, each zip record carrying a CRC-32.
#ifndef TESSERA_FORMAT_TORCH_DIST_DCP_FORMAT_H_
#define TESSERA_FORMAT_TORCH_DIST_DCP_FORMAT_H_

#include "tessera/format.h"

namespace tessera {

// The codec the registry lists.
const Format& TorchDistFormat();

}  // namespace tessera

#endif  // TESSERA_FORMAT_TORCH_DIST_DCP_FORMAT_H_
