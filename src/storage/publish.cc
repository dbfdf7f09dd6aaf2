// Storage::Publish through a temporary name and a rename (include/tessera/storage.h): the one
// implementation of "write aside, sync, rename into place, sync the directory" that every
// commit of tessera uses on a store with rename.
#include <cstdio>
#include <random>
#include <string>

#include "tessera/storage.h"

namespace tessera {
namespace {

constexpr std::string_view kTemporaryTag = ".tsr-tmp-";
constexpr size_t kTemporaryDigits = 16;
// A temporary removed under us is retried this many times with a fresh name, then the error
// stands (something removes every temporary it sees, faster than we can rename one).
constexpr int kAttempts = 4;

// The directory holding `path` ("." for a bare name).
std::string ParentOf(const std::string& path) {
  const size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  const size_t slash = path.rfind('/', end);
  if (slash == std::string::npos) return ".";
  const size_t parent_end = path.find_last_not_of('/', slash);
  return parent_end == std::string::npos ? "/" : path.substr(0, parent_end + 1);
}

}  // namespace

std::string PublishTemporaryName(const std::string& path) {
  // The kernel's random source: not predictable from the directory, and independent of the
  // attempt, so a name a killed attempt left is never chosen again (64 bits).
  std::random_device device;
  const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
  char digits[kTemporaryDigits + 1];
  std::snprintf(digits, sizeof(digits), "%016llx", static_cast<unsigned long long>(bits));
  return path + std::string(kTemporaryTag) + digits;
}

bool ParsePublishTemporaryName(std::string_view name, std::string* target) {
  const size_t at = name.rfind(kTemporaryTag);
  if (at == std::string_view::npos || at == 0 ||
      name.size() != at + kTemporaryTag.size() + kTemporaryDigits) {
    return false;
  }
  for (char c : name.substr(at + kTemporaryTag.size())) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  if (target) *target = std::string(name.substr(0, at));
  return true;
}

StorageCapabilities Storage::capabilities() const {
  return StorageCapabilities{.rename = true,
                             .positional_writes = true,
                             .directory_sync = true,
                             .conditional_create = true};
}

Status Storage::Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                        bool sync) {
  return PublishThroughRename(path, bytes, mode, sync);
}

Status Storage::PublishThroughRename(const std::string& path, std::span<const std::byte> bytes,
                                     PublishMode mode, bool sync) {
  Status status;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const std::string temp = PublishTemporaryName(path);
    Result<std::unique_ptr<WritableFile>> file = NewWritableFile(temp, CreateMode::kExclusive);
    if (!file.ok() && file.status().code() == StatusCode::kAlreadyExists) {
      status = file.status();
      continue;  // 64 random bits met an existing name: draw again
    }
    TESSERA_RETURN_IF_ERROR_CTX(file.status(), "publishing " + path);
    status = (*file)->WriteAt(0, bytes.data(), bytes.size());
    if (status.ok() && sync) status = (*file)->Sync();
    const Status closed = (*file)->Close();
    if (status.ok()) status = closed;
    if (status.ok()) {
      status = mode == PublishMode::kCreateOnly ? RenameNoReplace(temp, path) : Rename(temp, path);
      if (status.ok()) {
        return sync ? SyncDir(ParentOf(path)).WithContext("publishing " + path) : Status::Ok();
      }
      // Our temporary vanished (removed as a dead attempt's leftover): write it again.
      Result<FileType> left = Stat(temp);
      if (status.code() == StatusCode::kNotFound && left.ok() && *left == FileType::kNotFound) {
        continue;
      }
    }
    Remove(temp).IgnoreError();
    if (status.code() == StatusCode::kAlreadyExists) {  // kCreateOnly lost to another creator
      return Status(StatusCode::kAlreadyExists, "publishing " + path + ": it already exists");
    }
    return status.WithContext("publishing " + path);
  }
  return status.WithContext("publishing " + path + " (its temporary file was removed " +
                            std::to_string(kAttempts) + " times before it could be renamed)");
}

}  // namespace tessera
