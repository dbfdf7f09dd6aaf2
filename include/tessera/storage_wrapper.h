// StorageWrapper: a Storage that forwards every call to another one (LevelDB's EnvWrapper).
// Test doubles and decorators derive from it and override only what they change; a call added
// to Storage later is forwarded here once, not in every double.
//
// Publish is forwarded whole: the wrapped store publishes in its own way (a rename for POSIX, a
// conditional put for an object store), and a wrapper sees it as one call. A wrapper that wants
// to see each step of a rename-based Publish (FaultInjectingStorage) overrides Publish to call
// PublishThroughRename, which makes its steps through the wrapper's own overrides.
//
// Thread safety: that of the wrapped Storage.
#ifndef TESSERA_STORAGE_WRAPPER_H_
#define TESSERA_STORAGE_WRAPPER_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/storage.h"

namespace tessera {

class StorageWrapper : public Storage {
 public:
  explicit StorageWrapper(std::shared_ptr<Storage> target) : target_(std::move(target)) {}

  // The wrapped storage.
  Storage& target() const { return *target_; }
  const std::shared_ptr<Storage>& shared_target() const { return target_; }

  StorageCapabilities capabilities() const override { return target_->capabilities(); }
  Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                 bool sync) override {
    return target_->Publish(path, bytes, mode, sync);
  }
  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override {
    return target_->NewWritableFile(path, mode);
  }
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    return target_->NewReadableFile(path);
  }
  Status CreateDirs(const std::string& path) override { return target_->CreateDirs(path); }
  Result<FileType> Stat(const std::string& path) override { return target_->Stat(path); }
  Result<bool> IsSymlink(const std::string& path) override { return target_->IsSymlink(path); }
  Result<std::vector<std::string>> ListDir(const std::string& dir) override {
    return target_->ListDir(dir);
  }
  Status Rename(const std::string& from, const std::string& to) override {
    return target_->Rename(from, to);
  }
  Status RenameNoReplace(const std::string& from, const std::string& to) override {
    return target_->RenameNoReplace(from, to);
  }
  Status Remove(const std::string& path) override { return target_->Remove(path); }
  Status RemoveDir(const std::string& path) override { return target_->RemoveDir(path); }
  Status SyncDir(const std::string& dir) override { return target_->SyncDir(dir); }

 private:
  std::shared_ptr<Storage> target_;
};

}  // namespace tessera

#endif  // TESSERA_STORAGE_WRAPPER_H_
