#include "tessera/metadata.h"

#include <algorithm>

namespace tessera {

namespace {
template <typename T>
const T* FindByKey(const std::vector<T>& sorted, const std::string& key) {
  auto it = std::lower_bound(sorted.begin(), sorted.end(), key,
                             [](const T& item, const std::string& k) { return item.key < k; });
  return it != sorted.end() && it->key == key ? &*it : nullptr;
}
}  // namespace

const TensorInfo* Metadata::FindTensor(const std::string& key) const {
  return FindByKey(tensors, key);
}

const ObjectInfo* Metadata::FindObject(const std::string& key) const {
  return FindByKey(objects, key);
}

uint64_t Metadata::TotalTensorBytes() const {
  uint64_t total = 0;
  for (const TensorInfo& t : tensors) {
    const uint64_t element_size = DTypeSize(t.dtype);
    for (const ChunkInfo& c : t.chunks) {
      total += static_cast<uint64_t>(c.box.NumElements()) * element_size;
    }
  }
  return total;
}

uint64_t Metadata::TotalChunks() const {
  uint64_t total = 0;
  for (const TensorInfo& t : tensors) total += t.chunks.size();
  return total;
}

uint64_t NumChecksumBlocks(uint64_t length, uint64_t block_bytes) {
  if (block_bytes == 0 || length <= block_bytes) return 1;
  return (length + block_bytes - 1) / block_bytes;
}

const char* CheckpointFormatName(CheckpointFormat format) {
  switch (format) {
    case CheckpointFormat::kTessera:
      return "tessera";
    case CheckpointFormat::kTorchDist:
      return "torch_dist";
    case CheckpointFormat::kSafetensors:
      return "safetensors";
  }
  return "unknown";
}

}  // namespace tessera
