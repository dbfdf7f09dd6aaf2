// The write side of tessera's own format (docs/FORMAT.md, section 2): data files named
// DataFileName, each a safetensors file whose header names every chunk
// (ChunkEntryName) and object, the items' raw bytes back to back after it; the engine checksums
// every block.
#ifndef TESSERA_FORMAT_TESSERA_TESSERA_WRITER_H_
#define TESSERA_FORMAT_TESSERA_TESSERA_WRITER_H_

#include <memory>

#include "tessera/format_writer.h"

namespace tessera {

std::unique_ptr<FormatWriter> NewTesseraWriter();

}  // namespace tessera

#endif  // TESSERA_FORMAT_TESSERA_TESSERA_WRITER_H_
