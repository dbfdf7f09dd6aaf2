#include "manager/root_files.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <random>
#include <span>

#include "checkpoint/commit.h"

namespace tessera {

std::string StepDirName(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(step));
  return name;
}

std::optional<int64_t> ParseStepDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "iter_";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  const std::string_view digits = name.substr(kPrefix.size());
  if (digits.size() < 7 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  int64_t step = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  if (StepDirName(step) != name) return std::nullopt;  // one spelling per step
  return step;
}

namespace manager {

constexpr uint64_t kMaxSmallFile = 64 << 10;

namespace {

std::span<const std::byte> AsBytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

}  // namespace

// Both on the commit primitive (Storage::Publish): the file appears under its name with all of
// its bytes or not at all. A file created empty and then written would let another process
// read it in between: a tombstone without its owner lines looks like a dead deletion's, and a
// second deleter would take over a live one.
Status CreateSmallFile(Storage& storage, const std::string& path, std::string_view text,
                       bool sync) {
  return storage.Publish(path, AsBytes(text), PublishMode::kCreateOnly, sync);
}

Status ReplaceSmallFile(Storage& storage, const std::string& path, std::string_view text,
                        bool sync) {
  return storage.Publish(path, AsBytes(text), PublishMode::kReplace, sync);
}

Result<std::string> ReadSmallFile(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  if (file->size() > kMaxSmallFile) {
    return DataLoss(path + " is " + std::to_string(file->size()) + " bytes long; at most " +
                    std::to_string(kMaxSmallFile) + " expected");
  }
  std::string text(file->size(), '\0');
  TESSERA_RETURN_IF_ERROR(file->ReadAt(0, text.data(), text.size()));
  return text;
}

std::string RandomHex16() {
  std::random_device device;  // the kernel's random source
  const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(bits));
  return hex;
}

Result<StepDirFiles> ListStepDir(Storage& storage, const std::string& dir) {
  StepDirFiles files;
  TESSERA_ASSIGN_OR_RETURN(files.names, storage.ListDir(dir));
  for (const std::string& name : files.names) {
    // A small file being published ("tessera.reading.<hex>.tsr-tmp-<hex>") is none yet.
    if (ParsePublishTemporaryName(name, nullptr)) continue;
    if (name == kKeepFileName) files.marked = true;
    if (name == kTombstoneFileName) files.tombstone = true;
    if (name.starts_with(kLeasePrefix)) files.leases.push_back(name);
  }
  return files;
}

std::string LiveUser(Storage& storage, const std::string& dir, const StepDirFiles& files) {
  for (const std::string& lease : files.leases) {
    Result<std::string> text = ReadSmallFile(storage, JoinPath(dir, lease));
    if (text.ok() && OwnerRecordMayBeAlive(*text)) {
      return "being read by " + DescribeOwnerRecord(*text) + " (lease " + lease + ")";
    }
  }
  // The in-progress markers of saves, RemoveKeys and Finalize (format/commit.h): "" is no save
  // of ours, so anything else running is another operation.
  const SaveMarkers markers = FindSaveMarkers(storage, dir, files.names, "");
  for (const std::string& id : markers.running) {
    if (!id.empty()) return "being written by a running save (" + id + ")";
  }
  return "";
}

StepInfo ExamineStep(const std::shared_ptr<Storage>& storage, const std::string& root, int64_t step,
                     const StepDirFiles& files, Metadata* metadata, Status* damage) {
  StepInfo info;
  info.step = step;
  info.path = JoinPath(root, StepDirName(step));
  info.marked = files.marked;
  if (files.tombstone) {
    info.state = StepState::kDeleting;
    Result<std::string> text = ReadSmallFile(*storage, JoinPath(info.path, kTombstoneFileName));
    info.problem = text.ok() && OwnerRecordMayBeAlive(*text)
                       ? "being deleted by " + DescribeOwnerRecord(*text)
                       : "a deletion that did not finish (the next prune finishes it)";
    return info;
  }
  Metadata m;
  Result<bool> committed = IsCommitted(info.path, storage, &m);
  if (!committed.ok()) {
    info.state = StepState::kDamaged;
    info.problem = committed.status().message();
    if (damage != nullptr) *damage = committed.status();
    return info;
  }
  if (!*committed) {
    info.state = StepState::kUncommitted;
    return info;
  }
  auto recorded = m.user_metadata.find(kStepMetadataKey);
  if (recorded != m.user_metadata.end() && recorded->second != std::to_string(step)) {
    info.state = StepState::kDamaged;
    info.problem = info.path + " holds the checkpoint of step " + recorded->second +
                   " (its user metadata says so), not of step " + std::to_string(step);
    if (damage != nullptr) *damage = DataLoss(info.problem);
    return info;
  }
  info.state = StepState::kCommitted;
  if (metadata != nullptr) *metadata = std::move(m);
  return info;
}

Result<std::vector<int64_t>> ListStepNumbers(Storage& storage, const std::string& root,
                                             std::vector<std::string>* links) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(root));
  std::vector<int64_t> steps;
  for (const std::string& name : names) {
    if (std::optional<int64_t> step = ParseStepDirName(name)) {
      Result<bool> link = storage.IsSymlink(JoinPath(root, name));
      if (!link.ok() || *link) {  // an lstat that fails: not known to be a directory of ours
        if (links != nullptr) links->push_back(name);
        continue;
      }
      // A file of that name is not a step directory.
      Result<FileType> type = storage.Stat(JoinPath(root, name));
      if (type.ok() && *type == FileType::kDirectory) steps.push_back(*step);
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

namespace {

bool IsDataFile(const std::string& name) {
  return name.ends_with(".safetensors") || name.ends_with(".distcp");
}

// Takes the tombstone of `dir`: creates it, or takes over one whose owner died.
Status TakeTombstone(Storage& storage, const std::string& dir, bool sync) {
  const std::string path = JoinPath(dir, kTombstoneFileName);
  const std::string record = "tessera deletion\n" + ThisProcessOwnerRecord();
  Status created = CreateSmallFile(storage, path, record, sync);
  if (created.code() != StatusCode::kAlreadyExists) return created;
  Result<std::string> text = ReadSmallFile(storage, path);
  if (text.ok() && OwnerRecordMayBeAlive(*text)) {
    return FailedPrecondition(dir + " is being deleted by " + DescribeOwnerRecord(*text));
  }
  // The deletion that wrote it died: this one finishes it.
  return ReplaceSmallFile(storage, path, record, sync);
}

}  // namespace

Status DeleteStepDir(Storage& storage, const std::string& root, const std::string& dir, bool sync) {
  TESSERA_ASSIGN_OR_RETURN(bool link, storage.IsSymlink(dir));
  if (link) {
    return FailedPrecondition(dir + " is a symbolic link: tessera deletes nothing through it");
  }
  TESSERA_RETURN_IF_ERROR(TakeTombstone(storage, dir, sync));
  // Readers write their lease before they look for a tombstone; this looks for leases after
  // writing the tombstone: a reader this misses sees the tombstone and backs off.
  TESSERA_ASSIGN_OR_RETURN(StepDirFiles files, ListStepDir(storage, dir));
  const std::string user = LiveUser(storage, dir, files);
  if (!user.empty() || files.marked) {
    storage.Remove(JoinPath(dir, kTombstoneFileName)).IgnoreError();
    return FailedPrecondition(dir + (files.marked ? " is marked to be kept" : " is " + user));
  }
  std::vector<std::string> order;
  for (const std::string& name : files.names) {
    if (name != kTombstoneFileName && !IsDataFile(name)) order.push_back(name);
  }
  for (const std::string& name : files.names) {
    if (IsDataFile(name)) order.push_back(name);
  }
  for (const std::string& name : order) {
    Status removed = storage.Remove(JoinPath(dir, name));
    if (!removed.ok() && removed.code() != StatusCode::kNotFound) {
      return removed.WithContext("deleting " + dir);
    }
  }
  Status removed = storage.Remove(JoinPath(dir, kTombstoneFileName));
  if (!removed.ok() && removed.code() != StatusCode::kNotFound) return removed;
  Status dir_removed = storage.RemoveDir(dir);
  if (!dir_removed.ok() && dir_removed.code() != StatusCode::kNotFound &&
      dir_removed.code() != StatusCode::kUnimplemented) {  // a store without directories
    return dir_removed.WithContext("deleting " + dir);
  }
  if (sync) TESSERA_RETURN_IF_ERROR(storage.SyncDir(root));
  return Status::Ok();
}

}  // namespace manager
}  // namespace tessera
