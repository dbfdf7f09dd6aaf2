// Metadata: what a committed checkpoint holds, as recorded in its manifest. ReadMetadata
// returns it; the manifest encoder and decoder (docs/FORMAT.md) read and write exactly this.
#ifndef TESSERA_METADATA_H_
#define TESSERA_METADATA_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tessera/box.h"
#include "tessera/dtype.h"

namespace tessera {

// Where the bytes of one stored piece live.
struct ByteLocation {
  uint32_t file_index = 0;  // into Metadata::files
  uint64_t offset = 0;      // absolute byte offset in the file
  uint64_t length = 0;      // bytes
  uint64_t checksum = 0;    // XXH3-64 (seed 0) of those bytes
  friend bool operator==(const ByteLocation&, const ByteLocation&) = default;
};

// One saved box of a tensor, stored row-major and contiguous.
struct ChunkInfo {
  Box box;
  ByteLocation location;
  friend bool operator==(const ChunkInfo&, const ChunkInfo&) = default;
};

struct TensorInfo {
  std::string key;
  DType dtype = DType::kF32;
  Shape global_shape;
  std::vector<ChunkInfo> chunks;  // disjoint; cover the tensor exactly unless `partial`
  // Saved from ranks that together held only part of it (ShardedTensor::partial).
  bool partial = false;
  friend bool operator==(const TensorInfo&, const TensorInfo&) = default;
};

struct ObjectInfo {
  std::string key;
  ByteLocation location;
  friend bool operator==(const ObjectInfo&, const ObjectInfo&) = default;
};

struct FileInfo {
  std::string name;   // relative to the checkpoint directory; a plain file name
  uint64_t size = 0;  // bytes
  friend bool operator==(const FileInfo&, const FileInfo&) = default;
};

struct Metadata {
  uint32_t format_version = 0;
  std::string save_id;              // unique per save; part of every data file's name
  int32_t num_ranks = 0;            // ranks that saved
  std::vector<TensorInfo> tensors;  // sorted by key
  std::vector<ObjectInfo> objects;  // sorted by key
  std::vector<FileInfo> files;
  std::map<std::string, std::string> user_metadata;
  friend bool operator==(const Metadata&, const Metadata&) = default;

  // Binary search by key; null when absent.
  const TensorInfo* FindTensor(const std::string& key) const;
  const ObjectInfo* FindObject(const std::string& key) const;
  uint64_t TotalTensorBytes() const;
  uint64_t TotalChunks() const;
};

}  // namespace tessera

#endif  // TESSERA_METADATA_H_
