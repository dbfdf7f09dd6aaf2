// ShardedTensor: one rank's piece of a global tensor.
//
// The piece is the local box `[global_offset, global_offset + local_shape)` of a tensor of
// `global_shape`. Without a flat range, `data` holds the whole local box (data.shape ==
// local_shape). With a flat range [begin, end), `data` holds only the elements begin..end-1 of
// the row-major flattening of the local box, the way a distributed optimizer shards its state;
// data.shape is then {end - begin}.
#ifndef TESSERA_SHARDED_TENSOR_H_
#define TESSERA_SHARDED_TENSOR_H_

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/box.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/tensor_view.h"

namespace tessera {

// The most dimensions a tensor may have (what the manifest can record, docs/FORMAT.md).
inline constexpr size_t kMaxTensorRank = 64;

// Which copy of a replicated shard this is. All zeros (or empty) is the main replica, e.g.
// {tp_rank_replica, dp_rank} in Megatron terms. Only the main replica is written unless
// SaveOptions::balance_writes spreads the work.
using ReplicaId = std::vector<int32_t>;
bool IsMainReplica(const ReplicaId& id);

struct FlatRange {
  int64_t begin = 0;  // element index into the row-major flattening of the local box
  int64_t end = 0;    // exclusive
  friend bool operator==(const FlatRange&, const FlatRange&) = default;
};

struct ShardedTensor {
  std::string key;  // e.g. "decoder.layers.0.mlp.fc1.weight"
  TensorView data;  // local data; see the header comment for its shape
  Shape global_shape;
  std::vector<int64_t> global_offset;  // of the local box; empty means all zeros
  Shape local_shape;                   // of the local box; empty means data.shape (no flat range)
  ReplicaId replica_id;                // empty means main replica
  std::optional<FlatRange> flat_range;
  // Load only: a saved tensor whose global shape differs is accepted; the part of the local
  // box that lies inside the saved tensor is loaded and the rest is left untouched.
  bool allow_shape_mismatch = false;
  // Save only: the ranks together may hold only part of the tensor (the coverage check is
  // skipped for this key; loading a region nobody saved is an error). Default false.
  bool partial = false;

  // The whole tensor, held by one rank.
  static ShardedTensor Whole(std::string key, TensorView data);
  // A dense local box at `global_offset` of a tensor of `global_shape`.
  static ShardedTensor Shard(std::string key, TensorView data, Shape global_shape,
                             std::vector<int64_t> global_offset, ReplicaId replica_id = {});
  // The elements [begin, begin + data.NumElements()) of the local box
  // [global_offset, global_offset + local_shape).
  static ShardedTensor FlatShard(std::string key, TensorView data, Shape global_shape,
                                 std::vector<int64_t> global_offset, Shape local_shape,
                                 int64_t flat_begin, ReplicaId replica_id = {});
  // The same, from a Box's numbers (its offsets and sizes are Dims). A template, so that a
  // braced list ({} or {0, 4}) still means the vector overloads above.
  template <class Offsets>
  requires std::same_as<Offsets, Dims>
  static ShardedTensor Shard(std::string key, TensorView data, Shape global_shape,
                             const Offsets& global_offset, ReplicaId replica_id = {}) {
    return Shard(std::move(key), std::move(data), std::move(global_shape), global_offset.ToVector(),
                 std::move(replica_id));
  }
  template <class Offsets, class Sizes>
  requires(std::same_as<Offsets, Dims> || std::same_as<Sizes, Dims>) static ShardedTensor
      FlatShard(std::string key, TensorView data, Shape global_shape, const Offsets& global_offset,
                const Sizes& local_shape, int64_t flat_begin, ReplicaId replica_id = {}) {
    return FlatShard(std::move(key), std::move(data), std::move(global_shape),
                     std::vector<int64_t>(global_offset.begin(), global_offset.end()),
                     Shape(local_shape.begin(), local_shape.end()), flat_begin,
                     std::move(replica_id));
  }

  // The local box, with defaults applied.
  Box LocalBox() const;
  // Checks that shapes, offsets, flat range and data agree, that the dtype is a defined one,
  // that the rank is at most kMaxTensorRank and that the global tensor's element count and
  // byte size fit in an int64. Errors (InvalidArgument, or OutOfRange for a local box outside
  // the global shape) name the key.
  Status Validate() const;
};

// Opaque bytes stored under a key and handed back whole on load; never resharded.
struct ShardedObject {
  std::string key;
  std::vector<uint8_t> data;  // on load, replaced by the stored bytes
  ReplicaId replica_id;       // empty means main replica
  // What the bytes are: recorded in the manifest, so a reader (Python) knows how to give them
  // back, and used when writing another format (a torch.save archive for PyTorch DCP). On
  // load, set to the stored encoding. Default kBytes.
  ObjectEncoding encoding = ObjectEncoding::kBytes;

  friend bool operator==(const ShardedObject&, const ShardedObject&) = default;
};

}  // namespace tessera

#endif  // TESSERA_SHARDED_TENSOR_H_
