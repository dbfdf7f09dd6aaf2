// StateDict: an ordered map from key to ShardedTensor or ShardedObject; what one rank saves
// or asks for on load.
//
// Not thread-safe. Holds views: the tensors' memory is the caller's.
#ifndef TESSERA_STATE_DICT_H_
#define TESSERA_STATE_DICT_H_

#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "tessera/sharded_tensor.h"
#include "tessera/status.h"

namespace tessera {

using StateEntry = std::variant<ShardedTensor, ShardedObject>;

const std::string& EntryKey(const StateEntry& entry);

class StateDict {
 public:
  // Fails (naming the key) when the key is already present, is not valid UTF-8, or the tensor
  // is inconsistent (ShardedTensor::Validate).
  Status Add(ShardedTensor tensor);
  Status Add(ShardedObject object);

  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  bool Contains(const std::string& key) const { return index_.count(key) != 0; }
  // Null when absent.
  StateEntry* Find(const std::string& key);
  const StateEntry* Find(const std::string& key) const;

  // In insertion order.
  std::vector<StateEntry>& entries() { return entries_; }
  const std::vector<StateEntry>& entries() const { return entries_; }

 private:
  std::vector<StateEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace tessera

#endif  // TESSERA_STATE_DICT_H_
