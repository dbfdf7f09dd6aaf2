// Chunk checksums: XXH3-64 with seed 0 (docs/FORMAT.md).
#ifndef TESSERA_CORE_CHECKSUM_H_
#define TESSERA_CORE_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace tessera {

uint64_t Checksum(const void* data, size_t n);

// XXH3-128 (seed 0), as {low 64 bits, high 64 bits}: for telling contents apart (plan
// signatures), where 64 bits would make a collision among millions of values merely unlikely.
struct Checksum128Value {
  uint64_t low = 0;
  uint64_t high = 0;
};
Checksum128Value Checksum128(const void* data, size_t n);

// Streaming form, for bytes that arrive in pieces: the result equals Checksum() of the
// concatenation.
class ChecksumStream {
 public:
  ChecksumStream();
  ~ChecksumStream();
  ChecksumStream(const ChecksumStream&) = delete;
  ChecksumStream& operator=(const ChecksumStream&) = delete;
  // Starts over, as if newly constructed.
  void Reset();
  void Update(const void* data, size_t n);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t
};

}  // namespace tessera

#endif  // TESSERA_CORE_CHECKSUM_H_
