#include "checkpoint/sequence.h"

#include <algorithm>
#include <limits>

#include "format/tessera/manifest.h"

namespace tessera {
namespace {

// Stats of the numbers above a hint before a listing is cheaper (a hint this far behind is
// not worth following).
constexpr int kMaxProbes = 64;
// Publishes of one commit that keep finding their number taken (or below another) before the
// save gives up: a directory where others commit faster than this one can claim a number.
constexpr int kMaxClaims = 1000;
// The hint is a decimal number: a larger file is not one.
constexpr uint64_t kMaxHintBytes = 32;

std::span<const std::byte> AsBytes(const Bytes& bytes) { return std::as_bytes(std::span(bytes)); }

Result<bool> Exists(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(FileType type, storage.Stat(path));
  return type != FileType::kNotFound;
}

// The number the hint holds, or 0 when it is missing or not a number.
uint64_t ReadHint(Storage& storage, const std::string& dir) {
  Result<std::unique_ptr<ReadableFile>> file =
      storage.NewReadableFile(JoinPath(dir, kSequenceHintFileName));
  if (!file.ok() || (*file)->size() == 0 || (*file)->size() > kMaxHintBytes) return 0;
  std::string text((*file)->size(), '\0');
  if (!(*file)->ReadAt(0, text.data(), text.size()).ok()) return 0;
  uint64_t value = 0;
  for (char c : text) {
    if (c == '\n') break;
    if (c < '0' || c > '9' || __builtin_mul_overflow(value, 10, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(c - '0'), &value)) {
      return 0;
    }
  }
  return value;
}

Result<uint64_t> HighestByListing(Storage& storage, const std::string& dir) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(dir));
  return HighestCommit(names);
}

// Whether commit `seq`, just published, lies above every commit made before it. The commits
// present form one run (cleanups remove from the lowest up): when the one below is there, the
// run reached no higher than `seq` - 1 when `seq` was free, so nothing higher existed. When it
// is not (removed since, or never there), a listing says: nothing above `seq` means `seq` is
// the highest.
Result<bool> AboveEveryEarlierCommit(Storage& storage, const std::string& dir, uint64_t seq) {
  if (seq >= 2) {
    TESSERA_ASSIGN_OR_RETURN(bool below, Exists(storage, JoinPath(dir, CommitName(seq - 1))));
    if (below) return true;
  }
  TESSERA_ASSIGN_OR_RETURN(uint64_t highest, HighestByListing(storage, dir));
  return highest <= seq;
}

}  // namespace

Result<uint64_t> NextCommitNumber(const std::string& dir, uint64_t seq) {
  if (seq == std::numeric_limits<uint64_t>::max()) {
    return FailedPrecondition("cannot commit into " + dir + ": its newest commit is number " +
                              std::to_string(seq) +
                              ", the last a commit can take (2^64 - 1); save into another "
                              "directory or convert the checkpoint into one");
  }
  return seq + 1;
}

uint64_t HighestCommit(const std::vector<std::string>& names) {
  uint64_t highest = 0;
  for (const std::string& name : names) {
    uint64_t seq = 0;
    if (ParseCommitName(name, &seq)) highest = std::max(highest, seq);
  }
  return highest;
}

Result<uint64_t> FindHighestCommit(Storage& storage, const std::string& dir) {
  uint64_t seq = ReadHint(storage, dir);
  if (seq == 0) return HighestByListing(storage, dir);
  TESSERA_ASSIGN_OR_RETURN(bool there, Exists(storage, JoinPath(dir, CommitName(seq))));
  if (!there) return HighestByListing(storage, dir);  // stale: removed as superseded
  for (int probe = 0; probe < kMaxProbes; ++probe) {
    if (seq == std::numeric_limits<uint64_t>::max()) return seq;  // nothing above it
    TESSERA_ASSIGN_OR_RETURN(bool next, Exists(storage, JoinPath(dir, CommitName(seq + 1))));
    if (!next) return seq;
    ++seq;
  }
  return HighestByListing(storage, dir);
}

void WriteSequenceHint(Storage& storage, const std::string& dir, uint64_t seq) {
  const std::string text = std::to_string(seq) + "\n";
  storage
      .Publish(JoinPath(dir, kSequenceHintFileName),
               std::as_bytes(std::span(text.data(), text.size())), PublishMode::kReplace,
               /*sync=*/false)
      .IgnoreError();
}

Result<uint64_t> PublishNewestCommit(Storage& storage, const std::string& dir, Metadata metadata,
                                     uint64_t highest_known, bool sync, bool* visible) {
  return PublishNewestCommit(
      storage, dir,
      [&](uint64_t seq) -> Result<Bytes> {
        metadata.commit_seq = seq;
        return EncodeManifest(metadata);
      },
      highest_known, sync, visible);
}

bool PublishMayHavePlaced(Storage& storage, const std::string& path) {
  if (!storage.capabilities().rename) return true;
  const Result<FileType> type = storage.Stat(path);
  return !type.ok() || *type != FileType::kNotFound;
}

Result<uint64_t> PublishNewestCommit(Storage& storage, const std::string& dir,
                                     const std::function<Result<Bytes>(uint64_t seq)>& encode,
                                     uint64_t highest_known, bool sync, bool* visible) {
  TESSERA_ASSIGN_OR_RETURN(uint64_t seq, NextCommitNumber(dir, highest_known));
  for (int claim = 0; claim < kMaxClaims; ++claim) {
    TESSERA_ASSIGN_OR_RETURN(const Bytes bytes, encode(seq));
    const std::string path = JoinPath(dir, CommitName(seq));
    *visible = true;
    const Status published = storage.Publish(path, AsBytes(bytes), PublishMode::kCreateOnly, sync);
    if (published.code() == StatusCode::kAlreadyExists) {
      // another commit took the number first: the next
      TESSERA_ASSIGN_OR_RETURN(seq, NextCommitNumber(dir, seq));
      continue;
    }
    if (!published.ok()) {
      if (claim == 0 && !PublishMayHavePlaced(storage, path)) *visible = false;
      return published;
    }
    TESSERA_ASSIGN_OR_RETURN(bool newest, AboveEveryEarlierCommit(storage, dir, seq));
    if (newest) return seq;
    // A cleanup removed the numbers we were probing while a higher commit existed: ours would
    // load as older than a save that committed before it. Withdraw it, and go above.
    // (Gone already: a cleanup removed it as superseded.)
    if (Status withdrawn = storage.Remove(path);
        !withdrawn.ok() && withdrawn.code() != StatusCode::kNotFound) {
      return withdrawn.WithContext("withdrawing " + path + ", published below a newer commit");
    }
    TESSERA_ASSIGN_OR_RETURN(uint64_t highest, HighestByListing(storage, dir));
    TESSERA_ASSIGN_OR_RETURN(seq, NextCommitNumber(dir, std::max(seq, highest)));
  }
  return Aborted("could not commit into " + dir + ": " + std::to_string(kMaxClaims) +
                 " commit numbers were taken by others first");
}

Status PublishCommitAt(Storage& storage, const std::string& dir, uint64_t seq, const Bytes& bytes,
                       bool sync) {
  return storage.Publish(JoinPath(dir, CommitName(seq)), AsBytes(bytes), PublishMode::kCreateOnly,
                         sync);
}

std::string DescribeCommit(Storage& storage, const std::string& dir, uint64_t seq) {
  const std::string what = "commit " + std::to_string(seq);
  Result<std::unique_ptr<ReadableFile>> file =
      storage.NewReadableFile(JoinPath(dir, CommitName(seq)));
  if (!file.ok() || (*file)->size() > kMaxManifestBytes) return what;
  Bytes bytes((*file)->size());
  if (!(*file)->ReadAt(0, bytes.data(), bytes.size()).ok()) return what;
  Result<Metadata> m = DecodeManifest(bytes, JoinPath(dir, CommitName(seq)));
  if (!m.ok()) return what;
  if (m->rank_local_reference) {
    return what + " (the rank-local save " + m->save_id + " of " + std::to_string(m->num_ranks) +
           " ranks)";
  }
  return what + " (the save " + m->save_id + ")";
}

}  // namespace tessera
