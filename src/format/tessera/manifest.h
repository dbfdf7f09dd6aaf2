// The manifest: the binary index of a checkpoint (docs/FORMAT.md, "Manifest").
#ifndef TESSERA_FORMAT_TESSERA_MANIFEST_H_
#define TESSERA_FORMAT_TESSERA_MANIFEST_H_

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "format/tessera/names.h"  // the names of the files of the format
#include "tessera/bytes.h"
#include "tessera/metadata.h"
#include "tessera/status.h"

namespace tessera {

// The format version this build writes, and the newest it reads (it reads every older one).
inline constexpr uint32_t kFormatVersion = 3;
// Bytes per checksum block of the chunks Save writes (Metadata::checksum_block_bytes): a load
// that needs part of a chunk reads and checks whole blocks around what it needs, so this is the
// most a verified partial read reads beyond each end of a contiguous range it needs.
inline constexpr uint64_t kChecksumBlockBytes = 256u << 10;

// The fixed header (magic, format_version, flags, body_length) and trailer (checksum) around
// the body: a manifest is kManifestHeaderBytes + body_length + kManifestTrailerBytes bytes.
inline constexpr uint64_t kManifestHeaderBytes = 24;
inline constexpr uint64_t kManifestTrailerBytes = 8;
// The largest manifest a reader accepts (not stored; may be raised): 4 GiB, some 70 million
// 2-D chunks. Readers never allocate for a manifest more than its header declares, and that
// only once the file has exactly that size and its checksum matches.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{4} << 30;

// Checks what can be checked of a manifest of `file_size` bytes from its first
// min(file_size, kManifestHeaderBytes) bytes, `prefix`, before reading the rest: magic,
// version, that the file has exactly the size the header declares, and the size limit. Returns
// that size, or the error DecodeManifest would return (`source` prefixes it).
Result<uint64_t> CheckManifestHeader(std::span<const uint8_t> prefix, uint64_t file_size,
                                     std::string_view source);
// The error of a manifest whose trailing checksum does not match its bytes.
Status ManifestChecksumMismatch(std::string_view source);

// Serialises `metadata` in version kFormatVersion (format_version is ignored).
Bytes EncodeManifest(const Metadata& metadata);
// The encoding that carries the index of any registered format: between ranks (a load's
// ReadAndShareIndex) and through CheckAsManifest. A stored manifest records one of
// CheckpointFormat's enumerators as its source format (docs/FORMAT.md, 3.5: any other value is
// corrupt), and a format registered for tests (tessera/format_registry.h) has an id outside them,
// so this is the manifest of `metadata` recording tessera, after one byte holding Metadata::format.
// DecodeCarriedIndex checks what DecodeManifest checks.
Bytes EncodeCarriedIndex(const Metadata& metadata);
Result<Metadata> DecodeCarriedIndex(std::span<const uint8_t> bytes, std::string_view source);
// Version 2, which knows no commit sequence number and no references (they are dropped). For
// tests of the reader of version-2 directories.
Bytes EncodeManifestVersion2(const Metadata& metadata);
// Version 1, which knows no block checksums, chunk or object encodings, storage orders, save
// time or separate prefixes (they are dropped). For tests of the reader of old checkpoints.
Bytes EncodeManifestVersion1(const Metadata& metadata);

// Parses and checks a manifest of any version up to kFormatVersion: magic, version (a newer one
// is kUnimplemented naming both versions), checksum (kDataLoss), every length and index in
// range, file names that stay inside the checkpoint directory, dtypes known, chunk boxes inside
// their tensor's shape, disjoint, and covering it unless the tensor is partial.
// `source` (usually the path) prefixes every error.
Result<Metadata> DecodeManifest(std::span<const uint8_t> bytes, std::string_view source);

}  // namespace tessera

#endif  // TESSERA_FORMAT_TESSERA_MANIFEST_H_
