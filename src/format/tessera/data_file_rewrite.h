// A data file of tessera's format rewritten with only some of its items (tessera rm-keys,
// docs/FORMAT.md, section 4.1): the new file's safetensors header, made from the old file's own
// entries (names, dtypes and shapes stay as written, with the new save id in its metadata),
// and where each kept item lies in the new file, back to back after the header.
#ifndef TESSERA_FORMAT_TESSERA_DATA_FILE_REWRITE_H_
#define TESSERA_FORMAT_TESSERA_DATA_FILE_REWRITE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/box.h"
#include "tessera/bytes.h"
#include "tessera/dtype.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

// An item of the old file that the new one keeps, as the manifest places it.
struct KeptItem {
  uint64_t offset = 0;  // absolute, in the old file
  uint64_t length = 0;
  DType dtype = DType::kU8;  // objects: u8 of their length
  Shape shape;
  std::string what;  // for messages: "key 'k' chunk 3 [0:2, 0:4]" or "object 'o'"
};

struct RewrittenDataFile {
  Bytes header;
  std::vector<uint64_t> offsets;  // parallel to the kept items: absolute, in the new file
  uint64_t size = 0;              // of the new file
};

// The layout of `old_file` rewritten with `kept` only (sorted by offset) for save `save_id`.
// kDataLoss naming the file and the item when the old header does not describe an item as the
// manifest does; the header's own error when it does not parse.
Result<RewrittenDataFile> RewriteDataFileLayout(const ReadableFile& old_file,
                                                const std::vector<KeptItem>& kept,
                                                const std::string& save_id);

}  // namespace tessera

#endif  // TESSERA_FORMAT_TESSERA_DATA_FILE_REWRITE_H_
