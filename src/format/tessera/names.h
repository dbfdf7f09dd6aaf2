// The names of the files of tessera's format in a checkpoint directory, and their parsers: one
// place for every name (docs/FORMAT.md, sections 1 and 4), as LevelDB's db/filename.h. Data
// files, the manifests of commits, rank manifests, the sequence hint, save markers, and the
// temporary names older writers left.
#ifndef TESSERA_FORMAT_TESSERA_NAMES_H_
#define TESSERA_FORMAT_TESSERA_NAMES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

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
// Hex digits of a save id (NewSaveId: 16 lowercase hex digits).
inline constexpr size_t kSaveIdHexDigits = 16;
// The prefix of every data file name ("tsr-"); DataFileTag(id) is the prefix of a save's.
inline constexpr char kDataFilePrefix[] = "tsr-";

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

// "tsr-<save_id>": what every data file name of save `save_id` starts with (other formats'
// data files written by tessera carry it too: "__0_0.tsr-<id>.distcp").
std::string DataFileTag(std::string_view save_id);
// The save id of a data file name (IsTesseraDataFileName), or "" for any other name.
std::string SaveIdOfDataFileName(std::string_view name);

// Save markers: "tessera.saving.<id>"; the save id a marker name protects ("" for other names;
// a rank's "<save_id>.r<rank>" protects save_id).
std::string MarkerName(const std::string& id);
std::string MarkerSaveId(const std::string& name);
// The prefix of every marker name, and the suffix version 2 writers gave a marker's temporary.
inline constexpr char kMarkerPrefix[] = "tessera.saving.";
inline constexpr char kVersion2MarkerTempSuffix[] = ".tmp";

}  // namespace tessera

#endif  // TESSERA_FORMAT_TESSERA_NAMES_H_
