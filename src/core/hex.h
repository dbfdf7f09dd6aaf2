// Lower-case hexadecimal text: one copy for the library (checksums and save ids in messages,
// digests in S3's signatures and ETags, bytes named in parse errors).
#ifndef TESSERA_CORE_HEX_H_
#define TESSERA_CORE_HEX_H_

#include <cstdint>
#include <span>
#include <string>

namespace tessera {

// Two digits a byte, in order: {0xab, 0x01} -> "ab01".
std::string HexEncode(std::span<const uint8_t> bytes);
// Two digits: 0x0a -> "0a".
std::string HexByte(uint8_t byte);
// Sixteen digits, zero-padded: a 64-bit checksum as messages print it.
std::string Hex64(uint64_t value);

}  // namespace tessera

#endif  // TESSERA_CORE_HEX_H_
