// CRC-32 (ISO-HDLC / zip / gzip: reflected polynomial 0xEDB88320, initial value and final
// xor 0xFFFFFFFF), the checksum of every record of a zip archive and so of every tensor item
// of a PyTorch DCP checkpoint. Computed by ISA-L (crc32_gzip_refl: PCLMULQDQ/VPCLMULQDQ with
// run-time dispatch, several GB/s per core).
//
// Thread safety: pure functions; a Crc32Stream is a value used by one thread at a time.
#ifndef TESSERA_CORE_CRC32_H_
#define TESSERA_CORE_CRC32_H_

#include <cstddef>
#include <cstdint>

namespace tessera {

// CRC-32 of `n` bytes, continuing from `crc` (the CRC of the bytes before them; 0 to start):
// Crc32(b, Crc32(a)) == Crc32(a + b), the same convention as zlib's crc32().
uint32_t Crc32(const void* data, size_t n, uint32_t crc = 0);

// The CRC-32 of the concatenation A + B, from crc_a = Crc32(A), crc_b = Crc32(B) and the length
// of B in bytes, in O(log length_b) (zlib's crc32_combine). Lets threads that write different
// pieces of one record checksum them independently.
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

// Streaming form for bytes that arrive in pieces (e.g. 256 KiB at a time):
//   Crc32Stream s; s.Update(p1, n1); s.Update(p2, n2); s.value() == Crc32(p1 + p2).
class Crc32Stream {
 public:
  void Update(const void* data, size_t n) {
    crc_ = Crc32(data, n, crc_);
    length_ += n;
  }
  // Appends a piece whose CRC-32 was computed elsewhere (see Crc32Combine).
  void Append(uint32_t piece_crc, uint64_t piece_length) {
    crc_ = Crc32Combine(crc_, piece_crc, piece_length);
    length_ += piece_length;
  }
  uint32_t value() const { return crc_; }
  uint64_t length() const { return length_; }  // bytes seen so far
  void Reset() { crc_ = 0, length_ = 0; }

 private:
  uint32_t crc_ = 0;
  uint64_t length_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_CORE_CRC32_H_
