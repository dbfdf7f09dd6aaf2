// The manifest: the binary index of a checkpoint (docs/FORMAT.md, "Manifest").
#ifndef TESSERA_FORMAT_MANIFEST_H_
#define TESSERA_FORMAT_MANIFEST_H_

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tessera/bytes.h"
#include "tessera/metadata.h"
#include "tessera/status.h"

namespace tessera {

// The manifest of a version 1 or 2 directory: one name, replaced by every commit. A version 3
// reader reads it as commit 0 of the directory's sequence, below every numbered one.
inline constexpr char kVersion2ManifestFileName[] = "tessera.manifest";
// A hint, replaced (unsynced, best effort) after every commit: the decimal sequence number of
// the newest commit the writer knew. Rank 0 of a rank-local save starts its search for the next
// free number there instead of listing the directory; nothing trusts it further
// (docs/FORMAT.md, 4.3).
inline constexpr char kSequenceHintFileName[] = "tessera.latest";
// Hex digits of a rank-local attempt id in a data file name (IsAttemptId).
inline constexpr size_t kAttemptHexDigits = 8;
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

// Serialises `metadata` in version kFormatVersion (format_version is ignored). The same
// encoding carries the metadata of other formats between ranks (Metadata::format says which).
Bytes EncodeManifest(const Metadata& metadata);
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

// OK when `name` is a plain file name: not empty, not "." or "..", no '/', no NUL.
Status CheckDataFileName(std::string_view name);

// Data file names: "tsr-<save_id>-r<rank 5 digits>-f<file 3 digits>.safetensors"; with an
// `attempt` (rank-local saves, format version 3: kAttemptHexDigits lowercase hex digits drawn
// for each attempt of a rank, so that no two attempts of one tag ever share a file name)
// "tsr-<save_id>-r<rank>-a<attempt>-f<file>.safetensors".
std::string DataFileName(std::string_view save_id, int rank, int file_index,
                         std::string_view attempt = {});
// kAttemptHexDigits lowercase hex digits.
bool IsAttemptId(std::string_view attempt);
// The manifest of commit `seq` (>= 1) of a version 3 directory: "tessera.manifest." and the
// number in 20 decimal digits, zero-padded, so that the names sort in commit order. Written
// create-only: of two commits that want one number, one gets it.
std::string NumberedManifestName(uint64_t seq);
// True for the name of a commit, setting *seq: a numbered manifest (seq >= 1), or the
// version 2 manifest "tessera.manifest" (seq 0).
bool ParseCommitName(std::string_view name, uint64_t* seq);
// The name of commit `seq`: NumberedManifestName, or kVersion2ManifestFileName for 0.
std::string CommitName(uint64_t seq);
// True when `name` has the shape DataFileName produces (any save id): files tessera may remove
// after a later save commits.
bool IsTesseraDataFileName(std::string_view name);
// The manifest of rank `rank` of a rank-local save (SaveOptions::collective false):
// "tessera.manifest.rank-<save_id>-r<rank, 5+ digits>"; published create-only (version 2
// writers wrote it under the same name plus ".tmp", then renamed it).
std::string RankManifestName(std::string_view save_id, int rank);
// True when `name` is a rank manifest name (not its temporary name); sets the save id and rank.
bool ParseRankManifestName(std::string_view name, std::string* save_id, int* rank);

// Temporary name a version 2 writer wrote the manifest under before its rename (version 3
// commits through Storage::Publish, whose temporaries are PublishTemporaryName's); cleanups
// remove those a crash left.
std::string TempManifestName(std::string_view save_id);
bool IsTempManifestName(std::string_view name);

}  // namespace tessera

#endif  // TESSERA_FORMAT_MANIFEST_H_
