// MemoryStorage: a Storage that keeps every file in memory and models durability exactly, so
// tests can simulate a crash.
//
// Publish is Storage's rename-based default, made of the calls below, so it is modelled the
// same way (an unsynced publish may vanish in a crash, a synced one survives).
//
// Model: each file has volatile contents (what reads see) and durable contents (what survives
// a crash); WritableFile::Sync copies the first to the second. Each directory has a volatile
// and a durable set of entries; SyncDir(dir) makes dir's volatile entries durable. Rename and
// Remove change only the volatile entries. SimulateCrash() throws away everything volatile: a
// file whose entry was never made durable disappears, and a durable file keeps only its
// synced bytes.
//
// Thread-safe.
#ifndef TESSERA_MEMORY_STORAGE_H_
#define TESSERA_MEMORY_STORAGE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "tessera/storage.h"

namespace tessera {

class MemoryStorage : public Storage {
 public:
  MemoryStorage();
  ~MemoryStorage() override;

  StorageCapabilities capabilities() const override;

  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override;
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override;
  Status CreateDirs(const std::string& path) override;
  Result<FileType> Stat(const std::string& path) override;
  Result<std::vector<std::string>> ListDir(const std::string& dir) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status RenameNoReplace(const std::string& from, const std::string& to) override;
  Status Remove(const std::string& path) override;
  Status RemoveDir(const std::string& path) override;
  Status SyncDir(const std::string& dir) override;

  // Forgets everything not yet durable (see the header comment).
  void SimulateCrash();

  // Test helpers: direct access to a file's volatile bytes. Setting creates the file with a
  // durable entry and durable contents (as if it had been written and synced long ago).
  Result<std::vector<uint8_t>> GetFileContents(const std::string& path);
  void SetFileContents(const std::string& path, std::vector<uint8_t> contents);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace tessera

#endif  // TESSERA_MEMORY_STORAGE_H_
