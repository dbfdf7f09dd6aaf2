#include "core/checksum.h"

// Debian's libxxhash picks the fastest XXH3 kernel for this CPU at run time (SSE2, AVX2,
// AVX-512): on AVX-512 machines about twice the speed of the SSE2 code an -O2 build of the
// inline header would get. The hash values are the same whatever the kernel.
#include <xxh_x86dispatch.h>
#include <xxhash.h>

namespace tessera {

uint64_t Checksum(const void* data, size_t n) { return XXH3_64bits_dispatch(data, n); }

Checksum128Value Checksum128(const void* data, size_t n) {
  const XXH128_hash_t h = XXH3_128bits_dispatch(data, n);
  return {h.low64, h.high64};
}

ChecksumStream::ChecksumStream() : state_(XXH3_createState()) {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

ChecksumStream::~ChecksumStream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void ChecksumStream::Reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }

void ChecksumStream::Update(const void* data, size_t n) {
  XXH3_64bits_update_dispatch(static_cast<XXH3_state_t*>(state_), data, n);
}

uint64_t ChecksumStream::Digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

}  // namespace tessera
