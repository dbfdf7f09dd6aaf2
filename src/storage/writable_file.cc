// WritableFile's default CopyFrom (include/tessera/storage.h).
#include <algorithm>
#include <memory>

#include "tessera/storage.h"

namespace tessera {
namespace {

// The default copy's buffer: large enough that the calls cost little next to the bytes,
// small enough to stay in cache between the read and the write.
constexpr uint64_t kCopyBufferBytes = 1u << 20;

}  // namespace

Status WritableFile::CopyFrom(const ReadableFile& src, uint64_t src_offset, uint64_t dst_offset,
                              uint64_t n) {
  const size_t size = static_cast<size_t>(std::min(n, kCopyBufferBytes));
  std::unique_ptr<std::byte[]> buffer = std::make_unique_for_overwrite<std::byte[]>(size);
  for (uint64_t done = 0; done < n;) {
    const size_t piece = static_cast<size_t>(std::min<uint64_t>(size, n - done));
    TESSERA_RETURN_IF_ERROR_CTX(src.ReadAt(src_offset + done, buffer.get(), piece),
                                "copying into " + path());
    TESSERA_RETURN_IF_ERROR_CTX(WriteAt(dst_offset + done, buffer.get(), piece),
                                "copying from " + src.path());
    done += piece;
  }
  return Status::Ok();
}

}  // namespace tessera
