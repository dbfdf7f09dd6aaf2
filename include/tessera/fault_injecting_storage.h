// FaultInjectingStorage: wraps another Storage and makes a chosen operation fail, to prove
// that every failure leaves the committed checkpoint intact.
//
// Every call counts as one operation, storage calls and file calls alike (NewWritableFile,
// WriteAt, CopyFrom, Sync, Close, Rename, SyncDir, ...), numbered from 0 in the order they start.
// With fail_at = N, operation N fails with kIOError "injected fault at operation N (<op>
// <path>)". With crash = true every operation after N fails too, as if the process had died;
// pair it with MemoryStorage::SimulateCrash() to drop what was not yet durable.
//
// Thread-safe.
#ifndef TESSERA_FAULT_INJECTING_STORAGE_H_
#define TESSERA_FAULT_INJECTING_STORAGE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/storage.h"

namespace tessera {

struct FaultPlan {
  int64_t fail_at = -1;  // operation number to fail; -1 never fails
  bool crash = false;    // also fail every later operation
  // Only count operations whose path contains this substring (empty: all operations).
  std::string path_filter;
};

class FaultInjectingStorage : public Storage {
 public:
  explicit FaultInjectingStorage(std::shared_ptr<Storage> base, FaultPlan plan = {});

  // Resets the counter and installs a new plan.
  void SetPlan(FaultPlan plan);
  // Operations counted so far.
  int64_t operation_count() const;
  // True once the planned fault has fired.
  bool fault_fired() const;

  // The base's.
  StorageCapabilities capabilities() const override;

  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override;
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override;
  Status CreateDirs(const std::string& path) override;
  Result<FileType> Stat(const std::string& path) override;
  Result<std::vector<std::string>> ListDir(const std::string& dir) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status Remove(const std::string& path) override;
  Status RemoveDir(const std::string& path) override;
  Status SyncDir(const std::string& dir) override;

  // Counts one operation; returns the injected error if this one must fail. Used by the
  // file wrappers too.
  Status Check(const char* op, const std::string& path);

 private:
  std::shared_ptr<Storage> base_;
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace tessera

#endif  // TESSERA_FAULT_INJECTING_STORAGE_H_
