// The `.metadata` file of a PyTorch Distributed Checkpoint (DCP) directory, and of a
// Megatron-Core `torch_dist` checkpoint: a pickled `Metadata` object (docs/FORMAT_TORCH_DIST.md).
//
// ReadDcpMetadata interprets the pickle without importing anything: it recognises the DCP
// classes by their module paths (torch 1.13's torch.distributed._shard.checkpoint and torch
// 2.x's torch.distributed.checkpoint, Megatron's MCoreMetadata subclass) and turns them into the
// plain structs below. EncodeDcpMetadata writes them back as a pickle that torch's own
// pickle.load turns into the same objects torch would have written.
//
// Thread safety: plain values and pure functions.
#ifndef TESSERA_FORMAT_TORCH_DIST_DCP_METADATA_H_
#define TESSERA_FORMAT_TORCH_DIST_DCP_METADATA_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "format/torch_dist/pickle.h"
#include "tessera/status.h"

namespace tessera::torch_dist {

// Which class paths a .metadata uses.
enum class DcpFlavor : uint8_t {
  kTorch113,  // torch.distributed._shard.checkpoint.{metadata,filesystem}
  kTorch2,    // torch.distributed.checkpoint.{metadata,filesystem} (also Megatron's MCoreMetadata)
};
std::string_view DcpFlavorName(DcpFlavor flavor);

// TensorProperties.memory_format as pickled: the MEM_FORMAT_ENCODING enum's values.
enum class DcpMemoryFormat : uint8_t { kContiguous = 0, kChannelsLast = 1, kPreserve = 2 };

inline constexpr size_t kNoDcpStorage = static_cast<size_t>(-1);

// A ChunkStorageMetadata: one saved box of a tensor, in global coordinates.
struct DcpChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  // Index in DcpMetadata::storage of the item holding this chunk (LinkDcpStorage).
  size_t storage = kNoDcpStorage;
  bool operator==(const DcpChunk&) const = default;
};

// A TensorStorageMetadata with its key.
struct DcpTensor {
  std::string fqn;
  std::string torch_dtype;    // canonical torch dtype name: "float32", "bfloat16", ...
  std::vector<int64_t> size;  // global shape
  std::vector<DcpChunk> chunks;
  // The rest of TensorProperties (layout is always torch.strided; others are refused).
  bool requires_grad = false;
  bool pin_memory = false;
  DcpMemoryFormat memory_format = DcpMemoryFormat::kContiguous;
  bool operator==(const DcpTensor&) const = default;
};

// A BytesStorageMetadata with its key: an object saved with torch.save.
struct DcpBytes {
  std::string fqn;
  size_t storage = kNoDcpStorage;  // index in DcpMetadata::storage (LinkDcpStorage)
  bool operator==(const DcpBytes&) const = default;
};

// One storage_data entry: MetadataIndex -> _StorageInfo.
struct DcpStorage {
  std::string fqn;                             // MetadataIndex.fqn
  std::optional<std::vector<int64_t>> offset;  // MetadataIndex.offset; nullopt for bytes
  std::optional<int64_t> index;                // MetadataIndex.index: a hint only
  std::string relative_path;                   // data file, relative to the checkpoint dir
  uint64_t offset_in_file = 0;                 // _StorageInfo.offset: the item's first byte
  uint64_t length = 0;                         // _StorageInfo.length: the item's size in bytes
  bool operator==(const DcpStorage&) const = default;
};

// planner_data of torch 2.x's default planner with flatten_state_dict: fqn -> the path of the
// value in the original nested state dict (str keys and int list indices).
using DcpPathElement = std::variant<std::string, int64_t>;
struct DcpPlannerPath {
  std::string fqn;
  std::vector<DcpPathElement> path;
  bool operator==(const DcpPlannerPath&) const = default;
};
enum class DcpPlannerData : uint8_t {
  kNone,            // None or absent
  kFlattenMapping,  // a dict of fqn -> tuple path, in `planner_data`
  kOther,           // something else (a custom planner's); not interpreted
};

// StorageMeta (torch 2.x).
struct DcpStorageMeta {
  std::optional<std::string> checkpoint_id;  // a str, or a pathlib path joined with '/'
  std::optional<std::string> save_id;
  std::optional<std::string> load_id;
  std::vector<std::string> modules;
  bool operator==(const DcpStorageMeta&) const = default;
};

// Megatron-Core's mcore_data[key].
struct DcpMcoreEntry {
  std::string key;
  // "nd_reformulated_orig_global_shape": the original global shape of an N-D flattened
  // (distributed-optimizer) tensor whose DCP shape is axis_fragmentations + (numel,).
  std::optional<std::vector<int64_t>> nd_reformulated_orig_global_shape;
  bool operator==(const DcpMcoreEntry&) const = default;
};

struct DcpMetadata {
  DcpFlavor flavor = DcpFlavor::kTorch2;
  // The root object is Megatron's MCoreMetadata (module megatron.core.dist_checkpointing...).
  bool megatron_metadata_class = false;
  std::optional<std::string> version;  // Metadata.version (torch 2.x: "1.0.0")
  // state_dict_metadata, split by kind; each in pickle order.
  std::vector<DcpTensor> tensors;
  std::vector<DcpBytes> bytes;
  std::vector<DcpStorage> storage;  // storage_data, in pickle order
  DcpPlannerData planner_data_kind = DcpPlannerData::kNone;
  std::vector<DcpPlannerPath> planner_data;  // for kFlattenMapping
  std::optional<DcpStorageMeta> storage_meta;
  bool has_mcore_data = false;            // Megatron: mcore_data present
  std::vector<DcpMcoreEntry> mcore_data;  // in pickle order
  bool has_all_local_plans = false;       // Megatron: all_local_plans present (not read)
  bool operator==(const DcpMetadata&) const = default;
};

// What reading a .metadata may materialise, in bytes: kDcpExpansionFactor times the size of the
// pickle, plus kDcpExpansionFloor. A pickle names a value many times at a few bytes a reference
// (its memo), but every use of that value is a copy in DcpMetadata (and in the Metadata made
// from it): without this bound a 1 MB file could ask for 100 GB. Real files take a few times
// their size (each chunk is written out; only class names and fqn strings are shared).
inline constexpr uint64_t kDcpExpansionFactor = 32;
inline constexpr uint64_t kDcpExpansionFloor = uint64_t{16} << 20;
uint64_t DcpExpansionBudget(uint64_t input_bytes);

// Reads a .metadata pickle. `source` (the file path) prefixes every error. Errors (kDataLoss)
// name the attribute path ("state_dict_metadata['w'].chunks[2].sizes") and what was found; a
// pickle whose values would take more than DcpExpansionBudget(its size) bytes read (copies of
// values it references many times) is refused, naming the offset of the value referenced.
// Calls LinkDcpStorage.
Result<DcpMetadata> ReadDcpMetadata(std::span<const uint8_t> bytes, std::string_view source);
Result<DcpMetadata> InterpretDcpMetadata(const PickleTree& tree);

// Matches storage entries to what they store: by fqn, and for tensors by chunk offsets
// (MetadataIndex.index is tried first, as the hint it is). Sets DcpChunk::storage and
// DcpBytes::storage. Errors (kDataLoss, prefixed with `source`): duplicate fqns, a storage
// entry that matches nothing or a chunk already matched, a tensor chunk or bytes item without
// storage, chunk geometry that does not fit the tensor.
Status LinkDcpStorage(DcpMetadata& metadata, std::string_view source);

// Writes `metadata` as a .metadata pickle (protocol 4) with the class paths of
// `metadata.flavor`: real torch 1.13 unpickles the kTorch113 form, torch 2.x the kTorch2 form.
// Writes state_dict_metadata (tensors, then bytes), planner_data, storage_data, and for
// kTorch2 storage_meta and version. mcore_data, when has_mcore_data, becomes an extra attribute
// of the Metadata object (as Megatron-Core up to 0.14 wrote it: stock torch ignores it, Megatron
// reads it). The root class is always torch's Metadata, never MCoreMetadata, and
// all_local_plans is not written. InvalidArgument when the metadata is inconsistent (see
// LinkDcpStorage) or asks for what the flavour cannot hold (version or storage_meta in 1.13).
Result<std::vector<uint8_t>> EncodeDcpMetadata(const DcpMetadata& metadata);

}  // namespace tessera::torch_dist

#endif  // TESSERA_FORMAT_TORCH_DIST_DCP_METADATA_H_
