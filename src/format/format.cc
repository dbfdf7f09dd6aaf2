#include "format/format.h"

namespace tessera {

// The defaults: a format with no single-file checkpoints, no wrapped chunks and no checks of
// its own beyond tessera's block checksums and the safetensors headers.

Result<FormatIndex> Format::ReadFileIndex(Storage&, const std::string& dir,
                                          const std::string& file_name) const {
  return FailedPrecondition(JoinPath(dir, file_name) + " is a file, and a " + name() +
                            " checkpoint is a directory");
}

Status Format::ResolveWrappedChunks(Storage&, const std::string&, Metadata&,
                                    const std::vector<ChunkRef>&, int, FormatReadStats*) const {
  return Status::Ok();
}

Status Format::VerifyItems(Storage&, const std::string&, const Metadata&, int, uint64_t*, uint64_t*,
                           bool*) const {
  return Status::Ok();
}

Result<bool> Format::CheckObjectBytes(const ObjectInfo&, const std::vector<uint8_t>&,
                                      const std::string&) const {
  return false;
}

}  // namespace tessera
