// The copy path of a conversion (convert_writer.cc). A piece of a unit whose output bytes are
// the source's bytes as they lie (one contiguous byte range of each source chunk it crosses: a
// row-split or whole-tensor chunk, the full rows of a flat range; same dtype, no cast) goes
// from source file to output file without the load path, which plans every unit and takes it
// whole through a buffer as large as the unit, out of the CPU's cache between read and write:
//   - with source checksums to check: whole checksum blocks are read 1 MiB at a time into the
//     thread's buffer, checked, and written from it while still in cache; a block longer than
//     that (a chunk with one checksum) is hashed where it lies (ReadableFile::Map) or read
//     through the buffer, then copied with WritableFile::CopyFrom;
//   - without (Hugging Face or DCP sources, checks off): WritableFile::CopyFrom (POSIX:
//     copy_file_range, one copy inside the kernel).
// No byte is written before the block holding it is checked: a corrupt source fails the
// conversion as the load path does, naming the key, the chunk and the file.
#ifndef TESSERA_CHECKPOINT_CONVERT_COPY_H_
#define TESSERA_CHECKPOINT_CONVERT_COPY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "format/checkpoint_index.h"
#include "tessera/storage.h"

namespace tessera {

// Source bytes of a piece that lie in one chunk, back to back in the piece's output.
struct ChunkSpan {
  uint32_t chunk = 0;  // index into the tensor's chunks
  uint64_t file_offset = 0;
  uint64_t length = 0;
};

// The spans of elements [begin, end) of `metadata.tensors[tensor]`, in element order, when
// every element lies in a raw, row-major chunk whose elements form one run of the tensor's
// row-major order (sizes 1 in the dimensions before some k, full in those after it); nullopt
// otherwise (a column split, another dimension order, a torch.save item, a gap, no elements).
// With `verify`, also nullopt when a span is part of a chunk that has one checksum for more
// than a block (the load path decides whether such a part is checked: verify_partial_chunks).
std::optional<std::vector<ChunkSpan>> CopySpans(const Metadata& metadata, uint32_t tensor,
                                                int64_t begin, int64_t end, bool verify);

// One thread's data files of the source: each opened once (OpenDataFile: existence and size
// checked, errors naming the file and what needs it), kept open while the thread runs; and
// the thread's copy buffer (at most 1 MiB).
class SourceFiles {
 public:
  SourceFiles(Storage& storage, const CheckpointIndex& index) : storage_(storage), index_(index) {}
  Result<const ReadableFile*> Get(uint32_t file_index, const std::string& needed_by);
  std::vector<std::byte>& buffer() { return buffer_; }

 private:
  Storage& storage_;
  const CheckpointIndex& index_;
  std::map<uint32_t, std::unique_ptr<ReadableFile>> open_;
  std::vector<std::byte> buffer_;
};

struct CopyTarget {
  WritableFile* file = nullptr;
  uint64_t offset = 0;     // where the piece's first byte goes
  bool writeback = false;  // StartWriteback after every copy (SyncPolicy::kFull)
};

// Copies `spans` (of tensor `tensor`) back to back to `target`, checking first, when
// `verify`, every source checksum block they touch (a block at an edge is read whole).
// `copied(n)` runs after every n bytes copied; `read(n)` after every n source bytes hashed or
// copied. Errors: kDataLoss "checksum mismatch in key 'K' chunk C [box] ... of file F at
// offset O", or the storage's, with the key and chunk as context.
Status CopyPiece(SourceFiles& files, const CheckpointIndex& index, uint32_t tensor,
                 const std::vector<ChunkSpan>& spans, bool verify, const CopyTarget& target,
                 const std::function<void(uint64_t)>& copied,
                 const std::function<void(uint64_t)>& read);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_CONVERT_COPY_H_
