// Data files: every data file is a valid safetensors file (docs/FORMAT.md, "Data files").
//
//   u64 little-endian N | N bytes of JSON header, padded with spaces | data
//
// The header is padded so the data starts at a multiple of kDataAlignment. Entries are laid
// out back to back in the order given, with no holes, as safetensors requires.
#ifndef TESSERA_FORMAT_SAFETENSORS_H_
#define TESSERA_FORMAT_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/box.h"
#include "tessera/bytes.h"
#include "tessera/dtype.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

inline constexpr uint64_t kDataAlignment = 4096;
// safetensors readers reject headers larger than this.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
};

// The safetensors entry name of a chunk: `key` when the chunk is the whole tensor, else
// "<key>@<offset0>,<offset1>,..." ("<key>@" for a 0-d box).
std::string ChunkEntryName(const std::string& key, const Box& box, const Shape& global_shape);

// Lays out entries back to back. Input: name, dtype, shape of each entry (begin/end ignored).
// Output: entries with begin/end filled; returns the size of the data section in bytes.
uint64_t LayOutEntries(std::vector<SafetensorsEntry>& entries);

// The bytes that precede the data section: 8-byte length + JSON header + space padding; its
// size is a multiple of kDataAlignment. `metadata` becomes "__metadata__".
Result<Bytes> EncodeSafetensorsHeader(std::span<const SafetensorsEntry> entries,
                                      const std::map<std::string, std::string>& metadata);

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in the header's order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // absolute file offset of the data section
};

// Reads and parses the header of a data file, checking it the way a strict safetensors reader
// does (known dtypes, offsets consistent with shapes, no holes or overlaps, inside the file).
Result<SafetensorsHeader> ReadSafetensorsHeader(const ReadableFile& file);

}  // namespace tessera

#endif  // TESSERA_FORMAT_SAFETENSORS_H_
