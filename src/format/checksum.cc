#include "format/checksum.h"

// The whole of xxHash is compiled into this file, so nothing needs to link libxxhash.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tessera {

uint64_t Checksum(const void* data, size_t n) { return XXH3_64bits(data, n); }

ChecksumStream::ChecksumStream() : state_(XXH3_createState()) {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

ChecksumStream::~ChecksumStream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void ChecksumStream::Reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }

void ChecksumStream::Update(const void* data, size_t n) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, n);
}

uint64_t ChecksumStream::Digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

}  // namespace tessera
