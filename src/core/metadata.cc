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
    for (const ChunkInfo& c : t.chunks) total += c.location.length;
  }
  return total;
}

uint64_t Metadata::TotalChunks() const {
  uint64_t total = 0;
  for (const TensorInfo& t : tensors) total += t.chunks.size();
  return total;
}

}  // namespace tessera
