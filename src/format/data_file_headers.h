// The checks every read makes of data files whose format gives each a header describing its
// items (Format::DataFilesHaveHeaders: tessera's data files and Hugging Face's are safetensors
// files): that the header describes each chunk and object the index places in the file, as the
// index does. Other readers go by those headers (issue 22).
#ifndef TESSERA_FORMAT_DATA_FILE_HEADERS_H_
#define TESSERA_FORMAT_DATA_FILE_HEADERS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/dtype.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

// The shape of the array a chunk's bytes hold: its box's sizes, in storage_order when it has
// one (a chunk stored transposed is the row-major array of its sizes permuted).
inline Shape StoredShape(const ChunkInfo& chunk) {
  if (chunk.storage_order.empty()) return chunk.box.sizes.ToVector();
  Shape shape;
  for (uint8_t d : chunk.storage_order) {
    shape.push_back(d < chunk.box.sizes.size() ? chunk.box.sizes[d] : -1);
  }
  return shape;
}

// The header of each data file of one checkpoint, read once, when first needed, and kept for
// the checks of later reads. Thread-safe.
class DataFileHeaders {
 public:
  // OK when the header of `file` (data file `file_index` of the checkpoint) lists an entry at
  // `where` (absolute offset, length) of `dtype` and `shape`. Else kDataLoss naming the file:
  // the header's own error (then returned for every later check of the file too), or "the
  // safetensors header of <file> does not describe <what> at offset N as the manifest does".
  Status Check(const ReadableFile& file, uint32_t file_index, const ByteLocation& where,
               DType dtype, const Shape& shape, const std::string& what);
  // OK when the header of `file` (data file `file_index`) parses, for a file that holds no
  // item a caller checks (it is still one of the checkpoint's). Else the header's error.
  Status CheckParses(const ReadableFile& file, uint32_t file_index);

 private:
  // What the checks need of an entry (not its name: a load may keep the headers of every file
  // of a checkpoint of millions of chunks).
  struct Entry {
    uint64_t offset;  // absolute
    uint64_t length;
    DType dtype;
    Shape shape;
  };
  struct Parsed {
    Status status;               // of reading the header
    std::vector<Entry> entries;  // sorted by offset
  };
  // The header of data file `file_index`, read from `file` the first time. mu_ held.
  Parsed& ParsedLocked(const ReadableFile& file, uint32_t file_index);

  std::mutex mu_;
  std::map<uint32_t, std::unique_ptr<Parsed>> files_;
};

}  // namespace tessera

#endif  // TESSERA_FORMAT_DATA_FILE_HEADERS_H_
