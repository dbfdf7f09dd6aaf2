#include "tools/bench_io_storage.h"

#include <cstdio>
#include <memory>
#include <random>
#include <utility>

#include "checkpoint/reader_internal.h"  // CoalescingFile

namespace tessera::tools {

Status StorageRawWrite(Storage& storage, const std::string& path,
                       const std::vector<Segment>& segments) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                           storage.NewWritableFile(path, CreateMode::kTruncate));
  uint64_t offset = 0;
  for (const Segment& s : segments) {
    TESSERA_RETURN_IF_ERROR(file->WriteAt(offset, s.data, s.size));
    offset += s.size;
  }
  return file->Close();
}

Status StorageRawRead(Storage& storage, const std::string& path,
                      const std::vector<Segment>& segments) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  uint64_t total = 0;
  for (const Segment& s : segments) total += s.size;
  // Where each read is a request, small segments (a tensor each) are fetched together in reads
  // of the store's size, as a tuned client reads an object; larger ones go as they are.
  const uint64_t coalesce = storage.capabilities().coalesce_read_bytes;
  std::unique_ptr<ReadableFile> coalesced;
  if (coalesce > 0) {
    coalesced = std::make_unique<CoalescingFile>(
        *file, std::vector<std::pair<uint64_t, uint64_t>>{{0, total}}, coalesce);
  }
  const ReadableFile& in = coalesced ? *coalesced : *file;
  uint64_t offset = 0;
  for (const Segment& s : segments) {
    TESSERA_RETURN_IF_ERROR(in.ReadAt(offset, s.data, s.size));
    offset += s.size;
  }
  return Status::Ok();
}

Status RemoveStorageTree(Storage& storage, const std::string& dir) {
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (!names.ok()) {
    return names.status().code() == StatusCode::kNotFound ? Status::Ok() : names.status();
  }
  Status first;
  for (const std::string& name : *names) {
    const std::string path = JoinPath(dir, name);
    Result<FileType> type = storage.Stat(path);
    Status removed = !type.ok()                      ? type.status()
                     : *type == FileType::kDirectory ? RemoveStorageTree(storage, path)
                                                     : storage.Remove(path);
    if (!removed.ok() && removed.code() != StatusCode::kNotFound && first.ok()) first = removed;
  }
  Status gone = storage.RemoveDir(dir);
  if (!gone.ok() && gone.code() != StatusCode::kNotFound && first.ok()) first = gone;
  return first;
}

std::string NewBenchRunName() {
  std::random_device device;
  const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
  char id[17];
  std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(bits));
  return std::string("tessera-bench-io-") + id;
}

}  // namespace tessera::tools
