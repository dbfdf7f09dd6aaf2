// RemoveKeys: a new manifest without the removed keys, committed like a save's (docs/FORMAT.md,
// sections 4 and 4.1).
//
//   0. read the manifest; decide each data file's fate: kept as it is, dropped (only removed
//      chunks), or rewritten (kept and removed chunks)
//   1. marker, then the rewritten files under a new save id, each kept chunk copied and its
//      checksum blocks verified on the way, synced
//   2. the new manifest, committed atomically (the commit point)
//   3. cleanup: the files the new manifest does not list, then the marker
#include "tessera/remove_keys.h"
#include "tessera/storage_uri.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/commit.h"
#include "checkpoint/progress.h"
#include "checkpoint/reader.h"
#include "checkpoint/sequence.h"
#include "core/checksum.h"
#include "core/hex.h"
#include "core/utf8.h"
#include "format/checkpoint_index.h"
#include "format/registry.h"
#include "format/tessera/data_file_rewrite.h"
#include "format/tessera/manifest.h"

namespace tessera {
namespace {

// Bytes read, checksummed and written per call while copying a kept chunk.
constexpr uint64_t kCopyPiece = 1u << 20;

// A kept chunk or object of a rewritten file. `location` points into the new metadata: the
// copy moves it (offset here, file index once the file table is rebuilt).
struct KeptPiece {
  ByteLocation* location = nullptr;
  const std::vector<uint64_t>* blocks = nullptr;  // checksums after the first; null: objects
  DType dtype = DType::kU8;                       // to find its entry in the file's header
  Shape shape;
  std::string what;  // "key 'k' chunk 3 [0:2, 0:4]" or "object 'o'"
};

enum class Fate { kKeep, kDrop, kRewrite };

struct FilePlan {
  Fate fate = Fate::kKeep;
  uint64_t removed = 0;         // pieces of removed keys in the file
  std::vector<KeptPiece> kept;  // pieces of kept keys, sorted by offset
  // kRewrite only: the new file.
  std::string new_name;
  RewrittenDataFile layout;
};

// Adds the prefixes that removed something to the manifest's record of removed prefixes
// (kRemovedKeyPrefixesKey: a JSON array, kept sorted and unique across removals), so that a
// reader holding a description of the saved keys (Python's structure record) can tell removed
// keys from missing ones. A record that does not parse is replaced.
void RecordRemovedPrefixes(const std::vector<std::string>& prefixes,
                           const std::vector<uint64_t>& matches, Metadata& kept) {
  std::set<std::string> all;
  const auto it = kept.user_metadata.find(kRemovedKeyPrefixesKey);
  if (it != kept.user_metadata.end()) {
    const nlohmann::json old =
        nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
    if (old.is_array()) {
      for (const nlohmann::json& p : old) {
        if (p.is_string()) all.insert(p.get<std::string>());
      }
    }
  }
  for (size_t i = 0; i < prefixes.size(); ++i) {
    if (matches[i] > 0) all.insert(prefixes[i]);
  }
  // Every prefix is UTF-8 (CheckArguments) and the old record parsed as JSON; `replace` only
  // keeps dump() from ever throwing.
  kept.user_metadata[kRemovedKeyPrefixesKey] =
      nlohmann::json(all).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

bool Matches(const std::string& key, const std::vector<std::string>& prefixes,
             std::vector<uint64_t>& matches) {
  bool any = false;
  for (size_t p = 0; p < prefixes.size(); ++p) {
    if (key.starts_with(prefixes[p])) {
      ++matches[p];
      any = true;
    }
  }
  return any;
}

// "tsr-<id>-r<rank>-f<file>.safetensors" -> (rank, file); (0, fallback) for other names.
std::pair<int, int> RankAndFileOf(const std::string& name, int fallback) {
  if (!IsTesseraDataFileName(name)) return {0, fallback};
  const size_t r = name.find("-r", 4 + 16);
  const size_t f = name.find("-f", r + 2);
  return {std::atoi(name.c_str() + r + 2), std::atoi(name.c_str() + f + 2)};
}

// `kept`: the metadata without the removed keys (locations still the old ones); `files`: each
// old file's plan, pointing into `kept`.
void FilterMetadata(const Metadata& old, const std::vector<std::string>& prefixes,
                    RemoveKeysReport& report, Metadata& kept, std::vector<FilePlan>& files) {
  kept = old;
  kept.tensors.clear();
  kept.objects.clear();
  files.assign(old.files.size(), FilePlan{});
  report.matches_per_prefix.assign(prefixes.size(), 0);
  for (const TensorInfo& t : old.tensors) {
    if (Matches(t.key, prefixes, report.matches_per_prefix)) {
      report.removed_tensors.push_back(t.key);
      for (const ChunkInfo& c : t.chunks) files[c.location.file_index].removed += 1;
    } else {
      kept.tensors.push_back(t);
    }
  }
  for (const ObjectInfo& o : old.objects) {
    if (Matches(o.key, prefixes, report.matches_per_prefix)) {
      report.removed_objects.push_back(o.key);
      files[o.location.file_index].removed += 1;
    } else {
      kept.objects.push_back(o);
    }
  }
  for (TensorInfo& t : kept.tensors) {
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      ChunkInfo& chunk = t.chunks[c];
      files[chunk.location.file_index].kept.push_back(
          {&chunk.location, &chunk.block_checksums, t.dtype, chunk.box.sizes.ToVector(),
           "key '" + t.key + "' chunk " + std::to_string(c) + " " + chunk.box.ToString()});
    }
  }
  for (ObjectInfo& o : kept.objects) {
    files[o.location.file_index].kept.push_back({&o.location, nullptr, DType::kU8,
                                                 Shape{static_cast<int64_t>(o.location.length)},
                                                 "object '" + o.key + "'"});
  }
  for (FilePlan& f : files) {
    std::sort(f.kept.begin(), f.kept.end(), [](const KeptPiece& a, const KeptPiece& b) {
      return a.location->offset < b.location->offset;
    });
    if (f.removed > 0) f.fate = f.kept.empty() ? Fate::kDrop : Fate::kRewrite;
  }
}

// Lays out the rewritten file of old file `f`: its kept pieces back to back, as the format's
// header of the old file describes them (RewriteDataFileLayout).
Status LayOutRewrite(Storage& storage, const std::string& dir, const Metadata& old, uint32_t f,
                     const std::string& save_id, FilePlan& plan) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                           OpenDataFile(storage, dir, old, f, plan.kept.front().what));
  std::vector<KeptItem> items;
  for (const KeptPiece& piece : plan.kept) {
    items.push_back(KeptItem{piece.location->offset, piece.location->length, piece.dtype,
                             piece.shape, piece.what});
  }
  TESSERA_ASSIGN_OR_RETURN(plan.layout, RewriteDataFileLayout(*file, items, save_id));
  return Status::Ok();
}

// Copies `piece` from `in` to `out` at `to`, checking every checksum block of it on the way.
Status CopyPiece(const ReadableFile& in, WritableFile& out, const Metadata& old,
                 const KeptPiece& piece, uint64_t to, std::vector<uint8_t>& buffer,
                 ProgressMeter& meter) {
  const ByteLocation& from = *piece.location;
  const bool check = old.checksum != ChecksumKind::kNone;
  // Blocks of `block` bytes (the last one shorter), or one for all of the piece.
  const bool blocked = piece.blocks != nullptr && !piece.blocks->empty();
  const uint64_t block = blocked ? old.checksum_block_bytes : std::max<uint64_t>(from.length, 1);
  auto expected = [&](uint64_t b) { return b == 0 ? from.checksum : (*piece.blocks)[b - 1]; };
  ChecksumStream checksum;
  uint64_t block_index = 0;
  auto mismatch = [&](uint64_t block_end) {
    const std::string in_block = blocked
                                     ? " (block of bytes [" + std::to_string(block_index * block) +
                                           ", " + std::to_string(block_end) + ") of it)"
                                     : "";
    return DataLoss("checksum mismatch in " + piece.what + in_block + " of file " + in.path() +
                    " at offset " + std::to_string(from.offset) +
                    ", found while copying it: " + "expected " + Hex64(expected(block_index)) +
                    ", got " + Hex64(checksum.Digest()) + "; nothing was removed");
  };
  if (from.length == 0 && check && checksum.Digest() != from.checksum) return mismatch(0);
  for (uint64_t done = 0; done < from.length;) {
    const size_t n = static_cast<size_t>(std::min(kCopyPiece, from.length - done));
    buffer.resize(n);
    TESSERA_RETURN_IF_ERROR_CTX(in.ReadAt(from.offset + done, buffer.data(), n),
                                "reading " + piece.what);
    for (uint64_t at = 0; check && at < n;) {  // close every block the piece completes
      const uint64_t block_end = std::min(from.length, (block_index + 1) * block);
      const uint64_t take = std::min<uint64_t>(n - at, block_end - (done + at));
      checksum.Update(buffer.data() + at, take);
      at += take;
      if (done + at == block_end) {
        if (checksum.Digest() != expected(block_index)) return mismatch(block_end);
        checksum.Reset();
        ++block_index;
      }
    }
    TESSERA_RETURN_IF_ERROR(out.WriteAt(to + done, buffer.data(), n));
    meter.Add(n);
    done += n;
  }
  return Status::Ok();
}

// Writes the rewritten file of old file `f` and moves its pieces' locations to it.
Status WriteRewrite(Storage& storage, const std::string& dir, const Metadata& old, uint32_t f,
                    SyncPolicy sync, FilePlan& plan, ProgressMeter& meter, uint8_t& created) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> in,
                           OpenDataFile(storage, dir, old, f, plan.kept.front().what));
  TESSERA_ASSIGN_OR_RETURN(
      std::unique_ptr<WritableFile> out,
      storage.NewWritableFile(JoinPath(dir, plan.new_name), CreateMode::kExclusive));
  created = 1;
  const Bytes& header = plan.layout.header;
  TESSERA_RETURN_IF_ERROR(out->WriteAt(0, header.data(), header.size()));
  std::vector<uint8_t> buffer;
  for (size_t k = 0; k < plan.kept.size(); ++k) {
    const uint64_t to = plan.layout.offsets[k];
    TESSERA_RETURN_IF_ERROR(CopyPiece(*in, *out, old, plan.kept[k], to, buffer, meter));
    plan.kept[k].location->offset = to;
  }
  if (sync == SyncPolicy::kFull) TESSERA_RETURN_IF_ERROR(out->Sync());
  return out->Close();
}

// Step 1: every rewritten file, `threads` at once. On failure removes what it created.
Status WriteRewrites(Storage& storage, const std::string& dir, const Metadata& old,
                     const RemoveKeysOptions& options, std::vector<FilePlan>& files,
                     ProgressMeter& meter) {
  std::vector<uint32_t> todo;
  for (uint32_t f = 0; f < files.size(); ++f) {
    if (files[f].fate == Fate::kRewrite) todo.push_back(f);
  }
  std::vector<Status> statuses(todo.size());
  std::vector<uint8_t> created(todo.size(), 0);
  std::atomic<size_t> next{0};
  const size_t threads = std::min<size_t>(static_cast<size_t>(options.num_io_threads), todo.size());
  meter.ParallelFor(threads, [&](size_t) {
    for (size_t i; (i = next.fetch_add(1)) < todo.size();) {
      statuses[i] =
          WriteRewrite(storage, dir, old, todo[i], options.sync, files[todo[i]], meter, created[i])
              .WithContext("rewriting " + JoinPath(dir, old.files[todo[i]].name) + " as " +
                           files[todo[i]].new_name);
    }
  });
  for (const Status& s : statuses) {
    if (s.ok()) continue;
    for (size_t i = 0; i < todo.size(); ++i) {
      if (created[i]) storage.Remove(JoinPath(dir, files[todo[i]].new_name)).IgnoreError();
    }
    return s;
  }
  return Status::Ok();
}

// The file table of the new metadata: the kept files and the rewritten ones in the old order,
// every location pointed at its file's new index.
void RebuildFileTable(const Metadata& old, const std::vector<FilePlan>& files, Metadata& kept) {
  std::vector<uint32_t> new_index(files.size(), 0);
  kept.files.clear();
  for (size_t f = 0; f < files.size(); ++f) {
    if (files[f].fate == Fate::kDrop) continue;
    new_index[f] = static_cast<uint32_t>(kept.files.size());
    kept.files.push_back(files[f].fate == Fate::kRewrite
                             ? FileInfo{files[f].new_name, files[f].layout.size}
                             : old.files[f]);
  }
  for (TensorInfo& t : kept.tensors) {
    for (ChunkInfo& c : t.chunks) c.location.file_index = new_index[c.location.file_index];
  }
  for (ObjectInfo& o : kept.objects) o.location.file_index = new_index[o.location.file_index];
}

Status CheckArguments(const std::vector<std::string>& prefixes, const RemoveKeysOptions& o) {
  if (prefixes.empty()) return InvalidArgument("RemoveKeys: no key prefix given");
  for (const std::string& p : prefixes) {
    if (p.empty()) {
      return InvalidArgument("RemoveKeys: an empty key prefix would remove every key");
    }
    // Keys are UTF-8 (ShardedTensor, docs/FORMAT.md): a prefix that is not could only match
    // part of a character, and could not be recorded in the manifest's JSON. Refused, named.
    if (!IsValidUtf8(p)) {
      return InvalidArgument("RemoveKeys: the key prefix " + QuoteBytes(p) +
                             " is not valid UTF-8 (keys are UTF-8 text)");
    }
  }
  if (o.num_io_threads < 1) {
    return InvalidArgument("RemoveKeysOptions::num_io_threads must be at least 1, got " +
                           std::to_string(o.num_io_threads));
  }
  return Status::Ok();
}

// The commit the new manifest derives from: its number and a file whose presence shows that no
// cleanup has removed it as superseded (the commit itself; for a version 2 directory the
// version 2 manifest or the rank-local save's part of rank 0).
struct Base {
  uint64_t seq = 0;
  std::string witness;
};

Base BaseOf(const CheckpointIndex& index) {
  const Metadata& m = index.metadata;
  if (m.commit_seq > 0) return Base{m.commit_seq, CommitName(m.commit_seq)};
  return Base{0, index.rank_local ? RankManifestName(m.save_id, 0)
                                  : std::string(kVersion2ManifestFileName)};
}

// The removal gives way to commit `seq`, made after the base it started from.
Status Changed(Storage& storage, const std::string& path, uint64_t seq) {
  return Aborted("the checkpoint at " + path +
                 " changed while keys were being removed: " + DescribeCommit(storage, path, seq) +
                 " is newer than commit " + std::to_string(seq - 1) +
                 ", which the removal started from (the newer save is what the directory "
                 "holds); nothing was removed");
}

// Once the marker is in place, no cleanup that lists the directory removes a commit (cleanup.h):
// the base still there means no commit was made above it before (cleanups remove from the
// lowest up), and none can be made after without taking base + 1, which stays and which the
// commit below then finds taken.
Status CheckBaseIsNewest(Storage& storage, const std::string& path, const Base& base) {
  TESSERA_ASSIGN_OR_RETURN(FileType witness, storage.Stat(JoinPath(path, base.witness)));
  TESSERA_ASSIGN_OR_RETURN(const uint64_t after, NextCommitNumber(path, base.seq));
  TESSERA_ASSIGN_OR_RETURN(FileType next, storage.Stat(JoinPath(path, CommitName(after))));
  if (next != FileType::kNotFound) return Changed(storage, path, after);
  if (witness == FileType::kNotFound) {
    return Aborted("the checkpoint at " + path + " changed while keys were being removed (" +
                   base.witness + " was superseded and removed); nothing was removed");
  }
  return Status::Ok();
}

// Step 2: the new manifest as commit base + 1 exactly, create-only. Another commit made since the
// base was read holds that number (or one above it, and then this one too): the removal gives
// way. `visible` as CommitIndex's (commit.h).
Status CommitAfterBase(Storage& storage, const std::string& path, Metadata& kept, const Base& base,
                       SyncPolicy sync, bool& visible) {
  TESSERA_ASSIGN_OR_RETURN(kept.commit_seq, NextCommitNumber(path, base.seq));
  kept.part_rank = -1;
  kept.rank_local_reference = false;
  const Bytes bytes = EncodeManifest(kept);
  if (Result<Metadata> check = DecodeManifest(bytes, path); !check.ok()) {
    return InvalidArgument("the checkpoint would not be readable, nothing was committed: " +
                           check.status().message());
  }
  // A commit made meanwhile, whose cleanup removed the files this one keeps, is named as such.
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(path));
  const std::set<std::string> present(names.begin(), names.end());
  if (present.count(CommitName(kept.commit_seq))) return Changed(storage, path, kept.commit_seq);
  for (const FileInfo& f : kept.files) {
    if (!present.count(f.name)) {
      return DataLoss("data file " + JoinPath(path, f.name) + " vanished before the commit " +
                      "(removed by another process?); nothing was removed");
    }
  }
  const bool durable = sync == SyncPolicy::kFull;
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(path));
  visible = true;
  Status published = PublishCommitAt(storage, path, kept.commit_seq, bytes, durable);
  if (published.code() == StatusCode::kAlreadyExists) {
    visible = false;
    return Changed(storage, path, kept.commit_seq);
  }
  TESSERA_RETURN_IF_ERROR(published);
  WriteSequenceHint(storage, path, kept.commit_seq);
  return Status::Ok();
}

// Steps 1 to 3, once the plan is made.
Status Rewrite(Storage& storage, const std::string& path, const Metadata& old, const Base& base,
               const RemoveKeysOptions& options, std::vector<FilePlan>& files, Metadata& kept,
               ProgressMeter& meter) {
  TESSERA_RETURN_IF_ERROR(CreateSaveMarker(storage, path, kept.save_id, options.sync));
  struct MarkerGuard {
    Storage& storage;
    const std::string& path;
    const std::string& save_id;
    ~MarkerGuard() { RemoveSaveMarker(storage, path, save_id); }
  } marker{storage, path, kept.save_id};
  TESSERA_RETURN_IF_ERROR(CheckBaseIsNewest(storage, path, base));
  TESSERA_RETURN_IF_ERROR(WriteRewrites(storage, path, old, options, files, meter));
  RebuildFileTable(old, files, kept);
  bool visible = false;
  Status committed = CommitAfterBase(storage, path, kept, base, options.sync, visible);
  if (!committed.ok()) {
    if (!visible) {  // only the files this removal wrote: they carry its save id
      for (const FilePlan& f : files) {
        if (f.fate == Fate::kRewrite) storage.Remove(JoinPath(path, f.new_name)).IgnoreError();
      }
    }
    return committed.code() == StatusCode::kAborted
               ? committed
               : committed.WithContext("committing the manifest of " + path);
  }
  RemoveStaleFiles(storage, path, kept.save_id);
  return Status::Ok();
}

}  // namespace

Result<RemoveKeysReport> RemoveKeys(const std::string& path,
                                    const std::vector<std::string>& prefixes,
                                    const RemoveKeysOptions& options) {
  TESSERA_RETURN_IF_ERROR(CheckArguments(prefixes, options));
  if (!options.storage) {  // a URI (s3://, msc://, file://) or a local path
    TESSERA_ASSIGN_OR_RETURN(auto location, ResolveStorage(path, nullptr));
    RemoveKeysOptions resolved = options;
    resolved.storage = location.first;
    return RemoveKeys(location.second, prefixes, resolved);
  }
  const std::shared_ptr<Storage> storage = options.storage;
  TESSERA_ASSIGN_OR_RETURN(CheckpointIndex index, ReadCheckpointIndex(*storage, path));
  const Metadata& old = index.metadata;
  if (old.format != CheckpointFormat::kTessera) {
    return FailedPrecondition("cannot remove keys from " + path + ": it is a " +
                              FormatName(old.format) +
                              " checkpoint, and RemoveKeys rewrites tessera checkpoints only "
                              "(convert it to tessera first)");
  }
  // A directory whose newest commit is the last number takes no further commit: refused before
  // anything is planned or written (a dry run says so too).
  TESSERA_RETURN_IF_ERROR(NextCommitNumber(path, BaseOf(index).seq).status());
  RemoveKeysReport report;
  report.dry_run = options.dry_run;
  report.save_id = old.save_id;
  report.files_before = report.files_after = static_cast<int>(old.files.size());
  for (const FileInfo& f : old.files) report.bytes_before += f.size;
  report.bytes_after = report.bytes_before;
  Metadata kept;
  std::vector<FilePlan> files;
  FilterMetadata(old, prefixes, report, kept, files);
  ProgressMeter meter(options.progress, 0);
  if (report.removed_tensors.empty() && report.removed_objects.empty()) {
    meter.Finish();
    return report;  // nothing matched: nothing to write
  }
  RecordRemovedPrefixes(prefixes, report.matches_per_prefix, kept);
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->ListDir(path));
  kept.save_id = NewSaveId(names);
  int fallback = 1000;
  for (uint32_t f = 0; f < files.size(); ++f) {
    FilePlan& plan = files[f];
    if (plan.fate == Fate::kDrop) ++report.files_dropped;
    if (plan.fate != Fate::kRewrite) continue;
    ++report.files_rewritten;
    const auto [rank, file] = RankAndFileOf(old.files[f].name, fallback++);
    plan.new_name = DataFileName(kept.save_id, rank, file);
    TESSERA_RETURN_IF_ERROR(LayOutRewrite(*storage, path, old, f, kept.save_id, plan));
    for (const KeptPiece& piece : plan.kept) report.bytes_copied += piece.location->length;
  }
  report.files_after = report.files_before - report.files_dropped;
  report.bytes_after = 0;
  for (uint32_t f = 0; f < files.size(); ++f) {
    if (files[f].fate == Fate::kKeep) report.bytes_after += old.files[f].size;
    if (files[f].fate == Fate::kRewrite) report.bytes_after += files[f].layout.size;
  }
  meter.set_total(report.bytes_copied);
  if (!options.dry_run) {
    TESSERA_RETURN_IF_ERROR(
        Rewrite(*storage, path, old, BaseOf(index), options, files, kept, meter));
    report.save_id = kept.save_id;
  }
  meter.Finish();
  return report;
}

}  // namespace tessera
