// The order of commits in a directory, established by the directory itself (docs/FORMAT.md,
// section 4.3): every commit of a tessera index is a create-only Publish of
// "tessera.manifest.<n>", n one above the highest number there, and readers load the highest
// loadable one. No clock takes part: of two commits that want one number, the store lets
// exactly one create it, and the other takes the next.
//
// What keeps the numbers meaningful: cleanups remove superseded commits only from the lowest
// up (so the numbers present form one run, lowest to highest), and only when no other
// operation runs in the directory (cleanup.h); a commit whose number turns out to lie below a
// higher one that already existed (a cleanup that listed the directory before this operation
// started removed the numbers it probed) is withdrawn and made again above it.
#ifndef TESSERA_CHECKPOINT_SEQUENCE_H_
#define TESSERA_CHECKPOINT_SEQUENCE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tessera/bytes.h"  // Bytes
#include "tessera/metadata.h"
#include "tessera/storage.h"

namespace tessera {

// The commit after `seq` in `dir`: `seq` + 1, or kFailedPrecondition naming the directory and
// `seq` when `seq` is the last number a commit can take (2^64 - 1, docs/FORMAT.md section 4):
// the numbers never wrap, so a directory at the top takes no further commit (save into a new
// directory, or convert the checkpoint into one).
Result<uint64_t> NextCommitNumber(const std::string& dir, uint64_t seq);

// The highest commit number among `names` (entries of a directory): a numbered manifest's, 0
// for the version 2 manifest or when there is none.
uint64_t HighestCommit(const std::vector<std::string>& names);

// The highest commit number in `dir` without listing it when possible (rank 0 of a rank-local
// save does O(1) metadata operations): the hint file (kSequenceHintFileName), checked by a Stat
// of the commit it names and followed upward by Stats of the next numbers; a missing, stale or
// damaged hint costs one listing instead.
Result<uint64_t> FindHighestCommit(Storage& storage, const std::string& dir);

// Replaces the hint with `seq`, best effort and unsynced: nothing depends on it being there,
// current or durable.
void WriteSequenceHint(Storage& storage, const std::string& dir, uint64_t seq);

// After a Publish of `path` failed: whether it may have placed the file all the same. Exact on a
// store with rename (Publish is a write then a rename: the file is at `path`, complete, or is
// not there), so a failure before the rename leaves the data of the commit free to remove. On
// other stores (an object store, where a PUT whose replies were lost may still land) it may
// always have.
bool PublishMayHavePlaced(Storage& storage, const std::string& path);

// Publishes `metadata` (commit_seq set to the number it takes) as the newest commit of `dir`:
// create-only at `highest_known` + 1, one number higher each time another commit holds it.
// Once published, checks that the number is above every commit made before it (the commit
// below it is there; for number 1, a listing), else withdraws it and publishes again above the
// highest listed. With `sync`, durable on return. Returns the number; sets *visible once a
// publish may have made it visible (the data it points at must then be kept even on error;
// on a store with rename, a publish that failed and left no file did not).
Result<uint64_t> PublishNewestCommit(Storage& storage, const std::string& dir, Metadata metadata,
                                     uint64_t highest_known, bool sync, bool* visible);
// The same with the bytes of each number from `encode(seq)` (a format's index with
// Metadata::commit_seq = seq); an error from `encode` is returned as it is.
Result<uint64_t> PublishNewestCommit(Storage& storage, const std::string& dir,
                                     const std::function<Result<Bytes>(uint64_t seq)>& encode,
                                     uint64_t highest_known, bool sync, bool* visible);

// Publishes `bytes` as commit `seq` exactly, create-only: kAlreadyExists when another commit
// holds the number (RemoveKeys and Finalize derive their commit from `seq` - 1 and must not
// land above one they did not see).
Status PublishCommitAt(Storage& storage, const std::string& dir, uint64_t seq, const Bytes& bytes,
                       bool sync);

// "commit 12 (the save 0123456789abcdef)", "commit 13 (the rank-local save ... of 8 ranks)":
// what holds commit `seq` of `dir`, for an error message; "commit 12" when it cannot be read.
std::string DescribeCommit(Storage& storage, const std::string& dir, uint64_t seq);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_SEQUENCE_H_
