#include "tessera/fault_injecting_storage.h"

#include <mutex>
#include <utility>

namespace tessera {

namespace fault_injection_internal {

// The counter and the plan, shared by the storage and the files it opened (which may outlive
// it). FaultInjectingStorage::State is private, so the file wrappers see it as this base.
struct SharedState {
  std::mutex mu;
  FaultPlan plan;         // guarded by mu
  int64_t count = 0;      // operations counted under the current plan; guarded by mu
  bool fired = false;     // guarded by mu
  int64_t fired_at = -1;  // guarded by mu

  // Counts one operation and says whether it fails. Once a crash has fired every operation
  // fails, whether or not its path matches the filter: the process is dead.
  Status Check(const char* op, const std::string& path) {
    std::lock_guard<std::mutex> lock(mu);
    const bool counted =
        plan.path_filter.empty() || path.find(plan.path_filter) != std::string::npos;
    if (fired && plan.crash) {
      if (counted) ++count;
      return IOError("injected fault after crash at operation " + std::to_string(fired_at) + " (" +
                     op + " " + path + ")");
    }
    if (!counted) return Status::Ok();
    const int64_t n = count++;
    if (n != plan.fail_at) return Status::Ok();
    fired = true;
    fired_at = n;
    return IOError("injected fault at operation " + std::to_string(n) + " (" + op + " " + path +
                   ")");
  }
};

}  // namespace fault_injection_internal

struct FaultInjectingStorage::State : fault_injection_internal::SharedState {};

namespace {

using fault_injection_internal::SharedState;

class FaultInjectingReadableFile;

// The file a FaultInjectingReadableFile wraps, or `file` itself.
const ReadableFile& Unwrapped(const ReadableFile& file);

class FaultInjectingWritableFile : public WritableFile {
 public:
  FaultInjectingWritableFile(std::unique_ptr<WritableFile> base, std::shared_ptr<SharedState> state)
      : base_(std::move(base)), state_(std::move(state)) {}

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    TESSERA_RETURN_IF_ERROR(state_->Check("WriteAt", base_->path()));
    return base_->WriteAt(offset, data, n);
  }
  // One operation, whatever the length; the base copies from the unwrapped source, so a
  // POSIX base still copies in the kernel.
  Status CopyFrom(const ReadableFile& src, uint64_t src_offset, uint64_t dst_offset,
                  uint64_t n) override {
    TESSERA_RETURN_IF_ERROR(state_->Check("CopyFrom", base_->path()));
    return base_->CopyFrom(Unwrapped(src), src_offset, dst_offset, n);
  }
  Status StartWriteback(uint64_t offset, uint64_t n) override {
    TESSERA_RETURN_IF_ERROR(state_->Check("StartWriteback", base_->path()));
    return base_->StartWriteback(offset, n);
  }
  Status Sync() override {
    TESSERA_RETURN_IF_ERROR(state_->Check("Sync", base_->path()));
    return base_->Sync();
  }
  Status Close() override {
    TESSERA_RETURN_IF_ERROR(state_->Check("Close", base_->path()));
    return base_->Close();
  }
  const std::string& path() const override { return base_->path(); }

 private:
  const std::unique_ptr<WritableFile> base_;  // closes on destruction, uncounted
  const std::shared_ptr<SharedState> state_;
};

class FaultInjectingReadableFile : public ReadableFile {
 public:
  FaultInjectingReadableFile(std::unique_ptr<ReadableFile> base, std::shared_ptr<SharedState> state)
      : base_(std::move(base)), state_(std::move(state)) {}

  Status ReadAt(uint64_t offset, void* dst, size_t n) const override {
    TESSERA_RETURN_IF_ERROR(state_->Check("ReadAt", base_->path()));
    return base_->ReadAt(offset, dst, n);
  }
  uint64_t size() const override { return base_->size(); }
  const std::string& path() const override { return base_->path(); }
  const ReadableFile& base() const { return *base_; }

 private:
  const std::unique_ptr<ReadableFile> base_;
  const std::shared_ptr<SharedState> state_;
};

const ReadableFile& Unwrapped(const ReadableFile& file) {
  const auto* wrapper = dynamic_cast<const FaultInjectingReadableFile*>(&file);
  return wrapper != nullptr ? wrapper->base() : file;
}

}  // namespace

FaultInjectingStorage::FaultInjectingStorage(std::shared_ptr<Storage> base, FaultPlan plan)
    : base_(std::move(base)), state_(std::make_shared<State>()) {
  state_->plan = std::move(plan);
}

void FaultInjectingStorage::SetPlan(FaultPlan plan) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->plan = std::move(plan);
  state_->count = 0;
  state_->fired = false;
  state_->fired_at = -1;
}

int64_t FaultInjectingStorage::operation_count() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->count;
}

bool FaultInjectingStorage::fault_fired() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->fired;
}

Status FaultInjectingStorage::Check(const char* op, const std::string& path) {
  return state_->Check(op, path);
}

Result<std::unique_ptr<WritableFile>> FaultInjectingStorage::NewWritableFile(
    const std::string& path, CreateMode mode) {
  TESSERA_RETURN_IF_ERROR(Check("NewWritableFile", path));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base_->NewWritableFile(path, mode));
  return std::unique_ptr<WritableFile>(
      std::make_unique<FaultInjectingWritableFile>(std::move(file), state_));
}

Result<std::unique_ptr<ReadableFile>> FaultInjectingStorage::NewReadableFile(
    const std::string& path) {
  TESSERA_RETURN_IF_ERROR(Check("NewReadableFile", path));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, base_->NewReadableFile(path));
  return std::unique_ptr<ReadableFile>(
      std::make_unique<FaultInjectingReadableFile>(std::move(file), state_));
}

Status FaultInjectingStorage::CreateDirs(const std::string& path) {
  TESSERA_RETURN_IF_ERROR(Check("CreateDirs", path));
  return base_->CreateDirs(path);
}

Result<FileType> FaultInjectingStorage::Stat(const std::string& path) {
  TESSERA_RETURN_IF_ERROR(Check("Stat", path));
  return base_->Stat(path);
}

Result<std::vector<std::string>> FaultInjectingStorage::ListDir(const std::string& dir) {
  TESSERA_RETURN_IF_ERROR(Check("ListDir", dir));
  return base_->ListDir(dir);
}

Status FaultInjectingStorage::Rename(const std::string& from, const std::string& to) {
  // One path string naming both ends, so path_filter matches either.
  TESSERA_RETURN_IF_ERROR(Check("Rename", from + " -> " + to));
  return base_->Rename(from, to);
}

Status FaultInjectingStorage::Remove(const std::string& path) {
  TESSERA_RETURN_IF_ERROR(Check("Remove", path));
  return base_->Remove(path);
}

Status FaultInjectingStorage::RemoveDir(const std::string& path) {
  TESSERA_RETURN_IF_ERROR(Check("RemoveDir", path));
  return base_->RemoveDir(path);
}

StorageCapabilities FaultInjectingStorage::capabilities() const { return base_->capabilities(); }

Status FaultInjectingStorage::SyncDir(const std::string& dir) {
  TESSERA_RETURN_IF_ERROR(Check("SyncDir", dir));
  return base_->SyncDir(dir);
}

}  // namespace tessera
