#include "tessera/sharded_tensor.h"

#include <algorithm>
#include <string>

#include "core/utf8.h"
#include "tessera/state_dict.h"

namespace tessera {

bool IsMainReplica(const ReplicaId& id) {
  return std::all_of(id.begin(), id.end(), [](int32_t v) { return v == 0; });
}

ShardedTensor ShardedTensor::Whole(std::string key, TensorView data) {
  ShardedTensor t;
  t.key = std::move(key);
  t.global_shape = data.shape;
  t.data = std::move(data);
  return t;
}

ShardedTensor ShardedTensor::Shard(std::string key, TensorView data, Shape global_shape,
                                   std::vector<int64_t> global_offset, ReplicaId replica_id) {
  ShardedTensor t;
  t.key = std::move(key);
  t.data = std::move(data);
  t.global_shape = std::move(global_shape);
  t.global_offset = std::move(global_offset);
  t.replica_id = std::move(replica_id);
  return t;
}

ShardedTensor ShardedTensor::FlatShard(std::string key, TensorView data, Shape global_shape,
                                       std::vector<int64_t> global_offset, Shape local_shape,
                                       int64_t flat_begin, ReplicaId replica_id) {
  ShardedTensor t;
  t.key = std::move(key);
  int64_t n = data.NumElements();
  t.data = std::move(data);
  t.global_shape = std::move(global_shape);
  t.global_offset = std::move(global_offset);
  t.local_shape = std::move(local_shape);
  t.replica_id = std::move(replica_id);
  t.flat_range = FlatRange{flat_begin, flat_begin + n};
  return t;
}

Box ShardedTensor::LocalBox() const {
  Shape sizes = local_shape.empty() && !flat_range ? data.shape : local_shape;
  std::vector<int64_t> offsets =
      global_offset.empty() ? std::vector<int64_t>(global_shape.size(), 0) : global_offset;
  return Box(std::move(offsets), std::move(sizes));
}

namespace {

// Keys are UTF-8 text (docs/FORMAT.md): they end up in JSON headers, in Python strs, on
// terminals.
Status CheckKeyText(const std::string& key, const char* kind) {
  if (IsValidUtf8(key)) return Status::Ok();
  return InvalidArgument(std::string(kind) + " key " + QuoteBytes(key) +
                         " is not valid UTF-8 (keys are UTF-8 text)");
}

// True when the elements of `shape` (all >= 0), times `element_size`, fit in an int64.
bool FitsInt64Bytes(const Shape& shape, size_t element_size) {
  for (int64_t d : shape) {
    if (d == 0) return true;
  }
  int64_t n = static_cast<int64_t>(element_size);
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return false;
  }
  return true;
}

}  // namespace

Status ShardedTensor::Validate() const {
  auto fail = [&](const std::string& what) {
    return InvalidArgument("tensor '" + key + "': " + what);
  };
  if (key.empty()) return InvalidArgument("a tensor has an empty key");
  TESSERA_RETURN_IF_ERROR(CheckKeyText(key, "tensor"));
  if (!IsValidDType(static_cast<uint8_t>(data.dtype))) {
    return fail("dtype value " + std::to_string(static_cast<int>(data.dtype)) +
                " is not a tessera dtype");
  }
  if (global_shape.size() > kMaxTensorRank) {
    return fail("global shape has " + std::to_string(global_shape.size()) +
                " dimensions; at most " + std::to_string(kMaxTensorRank) + " are supported");
  }
  for (int64_t s : global_shape) {
    if (s < 0) return fail("negative global shape " + ShapeToString(global_shape));
  }
  // Every later computation on this tensor's boxes and bytes relies on this.
  if (!FitsInt64Bytes(global_shape, DTypeSize(data.dtype))) {
    return fail("global shape " + ShapeToString(global_shape) + " of " +
                std::string(DTypeName(data.dtype)) +
                " is too large: its size in bytes does not fit in an int64");
  }
  if (!global_offset.empty() && global_offset.size() != global_shape.size()) {
    return fail("global offset " + ShapeToString(global_offset) + " has " +
                std::to_string(global_offset.size()) + " dimensions, global shape " +
                ShapeToString(global_shape) + " has " + std::to_string(global_shape.size()));
  }
  if (flat_range && local_shape.empty() && !global_shape.empty()) {
    return fail("a flat range needs local_shape (the shape of the box it flattens)");
  }
  Box box = LocalBox();
  if (box.rank() != global_shape.size()) {
    return fail("local shape " + ShapeToString(box.sizes) + " has " + std::to_string(box.rank()) +
                " dimensions, global shape " + ShapeToString(global_shape) + " has " +
                std::to_string(global_shape.size()));
  }
  if (!box.InBounds(global_shape)) {
    return Status(StatusCode::kOutOfRange, "tensor '" + key + "': local box " + box.ToString() +
                                               " is outside the global shape " +
                                               ShapeToString(global_shape));
  }
  int64_t have = data.NumElements();
  if (flat_range) {
    if (flat_range->begin < 0 || flat_range->end < flat_range->begin ||
        flat_range->end > box.NumElements()) {
      return fail("flat range [" + std::to_string(flat_range->begin) + ", " +
                  std::to_string(flat_range->end) + ") is outside the " +
                  std::to_string(box.NumElements()) + " elements of local box " + box.ToString());
    }
    if (have != flat_range->end - flat_range->begin) {
      return fail("data holds " + std::to_string(have) + " elements, flat range needs " +
                  std::to_string(flat_range->end - flat_range->begin));
    }
  } else if (have != box.NumElements()) {
    return fail("data shape " + ShapeToString(data.shape) + " does not match local box " +
                box.ToString());
  }
  if (have > 0 && data.data == nullptr) return fail("data pointer is null");
  return Status::Ok();
}

const std::string& EntryKey(const StateEntry& entry) {
  return std::visit([](const auto& e) -> const std::string& { return e.key; }, entry);
}

Status StateDict::Add(ShardedTensor tensor) {
  TESSERA_RETURN_IF_ERROR(tensor.Validate());
  if (const auto it = keys_.find(tensor.key); it != keys_.end()) {
    const auto* first = std::get_if<ShardedTensor>(&entries_[it->second.first]);
    if (first == nullptr) {
      return InvalidArgument("duplicate key '" + tensor.key + "': it names an object already");
    }
    // Pieces of one tensor: the same tensor everywhere (the pieces' boxes are checked against
    // each other when a save or load plans, plan/local_pieces.h).
    if (first->data.dtype != tensor.data.dtype) {
      return InvalidArgument("tensor '" + tensor.key + "': this rank holds pieces of it of dtype " +
                             std::string(DTypeName(first->data.dtype)) + " and " +
                             std::string(DTypeName(tensor.data.dtype)));
    }
    if (first->global_shape != tensor.global_shape) {
      return InvalidArgument(
          "tensor '" + tensor.key + "': this rank holds pieces of it of global shape " +
          ShapeToString(first->global_shape) + " and " + ShapeToString(tensor.global_shape));
    }
  }
  const std::string key = tensor.key;
  return Insert(key, std::move(tensor));
}

Status StateDict::Add(ShardedObject object) {
  if (object.key.empty()) return InvalidArgument("an object has an empty key");
  TESSERA_RETURN_IF_ERROR(CheckKeyText(object.key, "object"));
  if (keys_.count(object.key)) return InvalidArgument("duplicate key '" + object.key + "'");
  const std::string key = object.key;
  return Insert(key, std::move(object));
}

Status StateDict::Insert(const std::string& key, StateEntry entry) {
  if (entries_.size() >= kNone) {
    return InvalidArgument("key '" + key + "': a state dict holds at most " +
                           std::to_string(kNone - 1) + " entries");
  }
  const auto index = static_cast<uint32_t>(entries_.size());
  auto [it, inserted] = keys_.try_emplace(key, KeySlot{index, index, 0});
  if (!inserted) next_[it->second.last] = index;
  it->second.last = index;
  it->second.count += 1;
  entries_.push_back(std::move(entry));
  next_.push_back(kNone);
  return Status::Ok();
}

StateEntry* StateDict::Find(const std::string& key) {
  auto it = keys_.find(key);
  return it == keys_.end() ? nullptr : &entries_[it->second.first];
}

const StateEntry* StateDict::Find(const std::string& key) const {
  auto it = keys_.find(key);
  return it == keys_.end() ? nullptr : &entries_[it->second.first];
}

size_t StateDict::CountOf(const std::string& key) const {
  auto it = keys_.find(key);
  return it == keys_.end() ? 0 : it->second.count;
}

std::vector<size_t> StateDict::IndicesOf(const std::string& key) const {
  std::vector<size_t> out;
  auto it = keys_.find(key);
  if (it == keys_.end()) return out;
  out.reserve(it->second.count);
  for (uint32_t i = it->second.first; i != kNone; i = next_[i]) out.push_back(i);
  return out;
}

}  // namespace tessera
