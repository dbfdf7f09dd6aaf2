// StateDict: the entries one rank saves or asks for on load: ShardedTensors and ShardedObjects,
// in insertion order, found by key.
//
// A key names one object, or one tensor of which this rank may hold any number of pieces:
// boxes and flat ranges, each a ShardedTensor with its own memory (Megatron's layers stacked on
// a prepended axis, a distributed optimizer's flat range of each layer's bucket, several local
// shards of a torch ShardedTensor). Save writes each piece from its memory and load lands each
// piece in its memory; no piece is copied into another. The pieces of a key must agree on dtype
// and global shape (Add checks) and must not share an element (checked when a save or load
// plans, in O(n log n) over the pieces; an error names the key and both pieces).
//
// Not thread-safe. Holds views: the tensors' memory is the caller's.
#ifndef TESSERA_STATE_DICT_H_
#define TESSERA_STATE_DICT_H_

#include <cstdint>
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
  // Adds one piece of a tensor. Fails (naming the key) when the key is not valid UTF-8, the
  // tensor is inconsistent (ShardedTensor::Validate), the key is an object's, or the key's
  // earlier pieces have another dtype or global shape.
  Status Add(ShardedTensor tensor);
  // Fails (naming the key) when the key is already present or is not valid UTF-8.
  Status Add(ShardedObject object);

  // Entries (pieces), not keys.
  size_t size() const { return entries_.size(); }
  size_t num_keys() const { return keys_.size(); }
  bool empty() const { return entries_.empty(); }
  bool Contains(const std::string& key) const { return keys_.count(key) != 0; }
  // The first entry of `key` (its only one, unless it is a tensor held in several pieces); null
  // when absent.
  StateEntry* Find(const std::string& key);
  const StateEntry* Find(const std::string& key) const;
  // The number of entries of `key` (0 when absent), and their indices into entries(), in
  // insertion order.
  size_t CountOf(const std::string& key) const;
  std::vector<size_t> IndicesOf(const std::string& key) const;

  // In insertion order. Changing an entry's key, kind, dtype or global shape through these
  // breaks the lookups above.
  std::vector<StateEntry>& entries() { return entries_; }
  const std::vector<StateEntry>& entries() const { return entries_; }

 private:
  static constexpr uint32_t kNone = ~uint32_t{0};
  struct KeySlot {
    uint32_t first = 0;  // entry index
    uint32_t last = 0;   // entry index
    uint32_t count = 0;
  };
  Status Insert(const std::string& key, StateEntry entry);

  std::vector<StateEntry> entries_;
  // The pieces of a key as a list through next_ (the next entry of the same key, or kNone):
  // no allocation per key beyond the map's node.
  std::vector<uint32_t> next_;
  std::unordered_map<std::string, KeySlot> keys_;
};

}  // namespace tessera

#endif  // TESSERA_STATE_DICT_H_
