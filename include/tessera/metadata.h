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

// Which format a checkpoint is in. ReadMetadata, Load and Verify detect it from the files;
// nobody names it to read. The numbers travel between ranks inside the manifest encoding
// (docs/FORMAT.md, section 3.5) and are permanent.
enum class CheckpointFormat : uint8_t {
  kTessera = 0,      // tessera.manifest + safetensors data files (docs/FORMAT.md)
  kTorchDist = 1,    // PyTorch DCP / Megatron-Core torch_dist (docs/FORMAT_TORCH_DIST.md)
  kSafetensors = 2,  // Hugging Face safetensors files, with or without an index JSON
};
// "tessera", "torch_dist", "safetensors".
const char* CheckpointFormatName(CheckpointFormat format);

// How stored bytes are checksummed (permanent numbers, as above).
enum class ChecksumKind : uint8_t {
  kNone = 0,     // the format has no checksums (PyTorch DCP, Hugging Face)
  kXxh3_64 = 1,  // XXH3-64, seed 0 (tessera)
  // Never in a manifest, nor in what ReadMetadata returns: the index a load of a PyTorch DCP
  // checkpoint makes of the items it reads. A chunk that is a whole zip record of its item has
  // the record's CRC-32 in location.checksum; one that is only part of its record (a view of a
  // larger storage, a box of an N-D reformulated item) has kUncheckedCrc32 there.
  kCrc32 = 2,
};
inline constexpr uint64_t kUncheckedCrc32 = uint64_t{1} << 32;

// How a chunk's bytes are stored in its location (permanent numbers, as above).
enum class ChunkEncoding : uint8_t {
  // The location holds the chunk's elements, row-major (or in `storage_order`), contiguous.
  kRaw = 0,
  // The location is a whole torch.save zip archive holding one tensor (a DCP item); the
  // chunk's elements start `payload_offset` bytes into that tensor's data. Loaders resolve it
  // into kRaw, reading only the archive's directory, for the chunks they touch.
  kTorchSaveItem = 1,
};

// What an object's bytes are (permanent numbers, as above). Tells Python how to give them back.
enum class ObjectEncoding : uint8_t {
  kBytes = 0,      // opaque bytes, returned as they are
  kPickle = 1,     // a Python pickle (tessera's Python package pickles non-bytes objects)
  kTorchSave = 2,  // a torch.save archive (DCP byte items, Megatron's common.pt); torch.load
  kJson = 3,       // UTF-8 JSON text (Megatron's metadata.json)
};

// Where the bytes of one stored piece live.
struct ByteLocation {
  uint32_t file_index = 0;  // into Metadata::files
  uint64_t offset = 0;      // absolute byte offset in the file
  uint64_t length = 0;      // bytes
  // Of the piece's first checksum block (Metadata::checksum_block_bytes), which is the whole
  // piece when it is no longer than a block; 0 when Metadata::checksum is kNone.
  uint64_t checksum = 0;
  friend bool operator==(const ByteLocation&, const ByteLocation&) = default;
};

// One saved box of a tensor.
struct ChunkInfo {
  Box box;
  ByteLocation location;
  // When the chunk is longer than Metadata::checksum_block_bytes: the checksums of its blocks
  // after the first (whose checksum is location.checksum), in order; the last block may be
  // shorter. Empty otherwise. A load that needs part of a chunk checks the blocks it touches.
  std::vector<uint64_t> block_checksums;
  ChunkEncoding encoding = ChunkEncoding::kRaw;
  // kTorchSaveItem only: byte offset of the chunk's first element in the item's tensor data.
  uint64_t payload_offset = 0;
  // Empty: row-major. Otherwise the dimensions from outermost to innermost as the bytes are
  // laid out (a saved transposed view is {1, 0}): a permutation of 0..rank-1.
  std::vector<uint8_t> storage_order;
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
  ByteLocation location;  // the whole object, one checksum (objects have no blocks)
  ObjectEncoding encoding = ObjectEncoding::kBytes;
  friend bool operator==(const ObjectInfo&, const ObjectInfo&) = default;
};

struct FileInfo {
  std::string name;   // relative to the checkpoint directory; a plain file name
  uint64_t size = 0;  // bytes
  friend bool operator==(const FileInfo&, const FileInfo&) = default;
};

struct Metadata {
  uint32_t format_version = 0;  // of the tessera manifest; 0 for other formats
  CheckpointFormat format = CheckpointFormat::kTessera;
  ChecksumKind checksum = ChecksumKind::kXxh3_64;
  // Bytes per checksum block of a chunk (see ChunkInfo::block_checksums); 0: one checksum
  // per chunk whatever its length (format version 1).
  uint64_t checksum_block_bytes = 0;
  std::string save_id;    // unique per save; part of every data file's name
  int32_t num_ranks = 0;  // ranks that saved (0 when the format does not say)
  // -1 for a whole checkpoint. Otherwise this is the rank manifest of rank `part_rank` of a
  // rank-local save (SaveOptions::collective false): only the chunks and objects that rank
  // wrote, so its tensors need not be covered; readers merge the num_ranks parts.
  int32_t part_rank = -1;
  // When the save committed (ms since 1970, UTC); 0 when unknown. Informational: saves are
  // ordered by commit_seq, never by a clock.
  int64_t save_time_unix_ms = 0;
  // Format version 3: the place of this commit in its directory's sequence of commits, the
  // number in its file name "tessera.manifest.<seq>" (docs/FORMAT.md, section 4); readers load
  // the highest loadable one. 0 when not committed into a sequence (a rank manifest, a
  // manifest of version 1 or 2, another format's index).
  uint64_t commit_seq = 0;
  // Format version 3: this is a reference (manifest kind 2), not an index. It holds no file,
  // tensor or object: it places the rank-local save `save_id` of `num_ranks` ranks at
  // `commit_seq` in the directory's order; readers load it, merged, once every part is there.
  bool rank_local_reference = false;
  std::vector<TensorInfo> tensors;  // sorted by key
  std::vector<ObjectInfo> objects;  // sorted by key
  std::vector<FileInfo> files;
  std::map<std::string, std::string> user_metadata;
  // Key prefixes whose chunks were written to data files of their own
  // (SaveOptions::separate_prefixes), sorted.
  std::vector<std::string> separate_prefixes;
  friend bool operator==(const Metadata&, const Metadata&) = default;

  // Binary search by key; null when absent.
  const TensorInfo* FindTensor(const std::string& key) const;
  const ObjectInfo* FindObject(const std::string& key) const;
  uint64_t TotalTensorBytes() const;  // of the tensors' elements
  uint64_t TotalChunks() const;
};

// Number of checksum blocks of a piece of `length` bytes with blocks of `block_bytes` (0: one).
uint64_t NumChecksumBlocks(uint64_t length, uint64_t block_bytes);

}  // namespace tessera

#endif  // TESSERA_METADATA_H_
