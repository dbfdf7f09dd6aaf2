// Pieces shared by the decoders of each manifest version (manifest.cc, manifest_v2.cc).
#ifndef TESSERA_FORMAT_TESSERA_MANIFEST_INTERNAL_H_
#define TESSERA_FORMAT_TESSERA_MANIFEST_INTERNAL_H_

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "core/utf8.h"
#include "tessera/bytes.h"
#include "tessera/metadata.h"
#include "tessera/status.h"

namespace tessera::manifest_internal {

// docs/FORMAT.md, section 3. Permanent.
inline constexpr size_t kHeaderBytes = 24;  // magic, format_version, flags, body_length
inline constexpr size_t kTrailerBytes = 8;  // checksum
// Reader limits (not stored; may be raised).
inline constexpr uint32_t kMaxRank = 64;
inline constexpr size_t kMaxSaveIdBytes = 128;
// Tensor flags (u8 after the rank). Bit values are permanent.
inline constexpr uint8_t kTensorPartial = 1;  // chunks may cover only part of the tensor

template <typename T>
T LoadLE(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Names in error messages are quoted by QuoteBytes (core/utf8.h): printable ASCII as it is,
// every other byte \xNN.
using ::tessera::QuoteBytes;

// Number of elements of `dims` (all >= 0) into *out; false when it does not fit an int64.
bool CountElements(const int64_t* dims, size_t rank, uint64_t* out);

// Like Box::ToString, for a box that may not be valid.
std::string UncheckedBoxString(const Box& box);

// Rules shared by every version, checked on what a version's decoder produced: save id
// characters, file names, sorted unique keys, a key never both a tensor and an object, and
// every tensor's chunks disjoint and (unless partial) covering it exactly. `corrupt` builds the
// error from a description.
Status ValidateDecoded(const Metadata& m, std::string_view source);

// The body decoders. `body` excludes header and trailer.
Result<Metadata> DecodeBodyVersion1(std::span<const uint8_t> body, std::string_view source);
// Versions 2 and 3 (3 adds the commit sequence number and references, docs/FORMAT.md 3.6).
Result<Metadata> DecodeBody(std::span<const uint8_t> body, std::string_view source,
                            uint32_t version);
// The version 2 or 3 body of `m`, recording `format` as its source format.
Bytes EncodeBody(const Metadata& m, uint32_t version, CheckpointFormat format);

}  // namespace tessera::manifest_internal

#endif  // TESSERA_FORMAT_TESSERA_MANIFEST_INTERNAL_H_
