// Storage: every file operation tessera performs goes through this interface, so the same
// save and load code runs on POSIX files, in memory, or under fault injection.
//
// Paths are plain strings handed to the implementation as they are ("/ckpt/step100/x").
// Implementations: NewPosixStorage() (storage.h), MemoryStorage (memory_storage.h),
// FaultInjectingStorage (fault_injecting_storage.h); StorageWrapper (storage_wrapper.h) forwards
// every call to another Storage, for test doubles that change one.
//
// Thread safety: Storage and file objects are safe to use from several threads at once;
// concurrent WriteAt calls on one file must target disjoint byte ranges.
#ifndef TESSERA_STORAGE_H_
#define TESSERA_STORAGE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/status.h"

namespace tessera {

class ReadableFile;

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes `n` bytes at `offset`, all of them or an error (short writes are retried).
  virtual Status WriteAt(uint64_t offset, const void* data, size_t n) = 0;
  // A hint: start writing bytes [offset, offset + n) to the device now, without waiting for
  // them and without making them durable (only Sync does). A save with SyncPolicy::kFull calls
  // it as it goes, so the device writes while later bytes are still being copied and the final
  // Sync has little left to do. The default does nothing.
  virtual Status StartWriteback(uint64_t offset, uint64_t n) {
    (void)offset;
    (void)n;
    return Status::Ok();
  }
  // Writes the `n` bytes of `src` at `src_offset` here at `dst_offset`, all of them or an
  // error naming both files. The bytes need not pass through the caller's memory: the POSIX
  // implementation copies inside the kernel (copy_file_range(2)), from page cache to page cache,
  // where the file systems allow it. The default reads and writes through a bounded buffer
  // (ReadAt + WriteAt, so reading past the end of `src` is ReadAt's kDataLoss error). It
  // writes like WriteAt (disjoint ranges from several threads) and is no more durable.
  // Contract: `src` is not modified during the copy (what a caller verified of its bytes
  // beforehand is what gets copied).
  virtual Status CopyFrom(const ReadableFile& src, uint64_t src_offset, uint64_t dst_offset,
                          uint64_t n);
  // Makes the written bytes durable (fdatasync). Until then a crash may lose them.
  virtual Status Sync() = 0;
  // Releases the file. Does not sync. Idempotent; the destructor closes too, ignoring errors.
  virtual Status Close() = 0;
  virtual const std::string& path() const = 0;
};

// Bytes of a file seen in memory (ReadableFile::Map). Move-only; the bytes stay readable
// until the mapping is destroyed.
class FileMapping {
 public:
  FileMapping() = default;
  // `release` runs once, when the mapping is destroyed or assigned over.
  FileMapping(std::span<const std::byte> bytes, std::function<void()> release)
      : bytes_(bytes), release_(std::move(release)) {}
  FileMapping(FileMapping&& other) noexcept
      : bytes_(std::exchange(other.bytes_, {})), release_(std::exchange(other.release_, {})) {}
  FileMapping& operator=(FileMapping&& other) noexcept {
    if (this != &other) {
      Release();
      bytes_ = std::exchange(other.bytes_, {});
      release_ = std::exchange(other.release_, {});
    }
    return *this;
  }
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping() { Release(); }

  std::span<const std::byte> bytes() const { return bytes_; }

 private:
  void Release() {
    if (release_) std::exchange(release_, {})();
  }

  std::span<const std::byte> bytes_;
  std::function<void()> release_;
};

class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Reads exactly `n` bytes at `offset` into `dst`. Reading past the end of the file is a
  // kDataLoss error naming the path, the range and the file size (a truncated file).
  virtual Status ReadAt(uint64_t offset, void* dst, size_t n) const = 0;
  // Optional: shows the `n` bytes at `offset` in memory, read-only, without copying them, so
  // that a caller can checksum them where they lie (Verify does). The default, and any
  // implementation that cannot, returns kUnimplemented; a caller treats every error of Map as
  // "use ReadAt" (which then reports what is really wrong). A range past the end of the file
  // is the same kDataLoss error as ReadAt's.
  // Contract: the file must not shrink while a mapping of it exists. On POSIX, touching a
  // mapped page past a new end of file raises SIGBUS; Map refuses a range past the file's
  // current end, but cannot stop another process from truncating later. tessera never
  // shrinks a file it reads: data files are written once, under names no other save uses.
  virtual Result<FileMapping> Map(uint64_t offset, size_t n) const {
    (void)offset;
    (void)n;
    return Unimplemented("Map is not supported for " + path());
  }
  // Size in bytes when the file was opened.
  virtual uint64_t size() const = 0;
  virtual const std::string& path() const = 0;
};

enum class FileType { kNotFound, kFile, kDirectory };

// What NewWritableFile does when the name already exists.
enum class CreateMode {
  // The name must be new (POSIX: open with O_CREAT | O_EXCL | O_NOFOLLOW). An existing file,
  // directory or symbolic link of that name, even a dangling link, is kAlreadyExists naming
  // the path; a symbolic link is never followed. Every file a save writes is created this way,
  // so nothing planted in a checkpoint directory can redirect a write to another file.
  kExclusive,
  // As kExclusive, for a name the caller drew at random for this file (a save's data files carry
  // a fresh save id): an existing name is still never written over, but a store may find it only
  // when the file is closed, Close then failing with kAlreadyExists (an object store saves the
  // request per file that would look first). POSIX and memory storage treat it as kExclusive.
  kExclusiveNewName,
  // Creates the file, or truncates an existing one to zero bytes (following symbolic links).
  kTruncate,
};

// What a store guarantees. Code that needs one of these checks it and says which store lacks
// it, rather than failing half-way (a store without `rename`, e.g. an object store, cannot hold
// the Hugging Face files of a `tessera convert`, each renamed to its name once complete).
struct StorageCapabilities {
  // Rename and RenameNoReplace move a file (Rename also a directory) to a new name atomically:
  // a reader sees the old name or the new one, never both missing, never a partial file.
  bool rename = false;
  // WritableFile::WriteAt may write at any offset, in any order, from several threads (a store
  // without it takes each file's bytes in order, from offset 0, once).
  bool positional_writes = false;
  // SyncDir makes the directory's entries durable; without it, a store makes every completed
  // creation, rename and removal durable by itself (SyncDir is then a no-op).
  bool directory_sync = false;
  // Creating a name that must not exist is atomic: NewWritableFile(kExclusive) and
  // Publish(kCreateOnly) fail with kAlreadyExists when the name exists, and of several
  // processes racing to create one name exactly one succeeds.
  bool conditional_create = false;
  // Each read costs a request (an object store): a small read costs about what one of this
  // many bytes does, so readers fetch the ranges they will read that touch each other
  // together, up to this many bytes a read. 0: small reads are cheap (a file system, memory).
  uint64_t coalesce_read_bytes = 0;
  // Directories are key prefixes (an object store): one exists while a file lies under it,
  // CreateDirs has nothing to create, and a file and a directory may share a name. Code that
  // would walk up a path checking each parent skips the walk (each check is a request).
  bool implicit_directories = false;
};

// How Publish treats a name that exists.
enum class PublishMode {
  kCreateOnly,  // fail with kAlreadyExists; of several racing creators exactly one wins
  kReplace,     // replace it atomically
};

class Storage {
 public:
  virtual ~Storage() = default;

  // What this store guarantees. The default is what the default Publish needs and what POSIX
  // file systems give: every capability.
  virtual StorageCapabilities capabilities() const;

  // Makes `bytes` the whole content of `path` atomically: readers see the previous content (or
  // no file) or all of the new one, never a part. kCreateOnly: fails with kAlreadyExists if
  // `path` exists; of several racing creators exactly one wins. kReplace: replaces. With
  // `sync`, durable on return (data and directory entry); without, a crash of the machine may
  // lose it (never tear it). Every commit of tessera (manifests, markers, rank manifests, the
  // DCP `.metadata`) is a Publish.
  // The default is PublishThroughRename. A store without rename (an object store) implements
  // it with its own atomic put (S3: PutObject, with If-None-Match: * for kCreateOnly).
  virtual Status Publish(const std::string& path, std::span<const std::byte> bytes,
                         PublishMode mode, bool sync);

  // Publish made of this storage's own calls, for a store with rename: the bytes go to a
  // temporary name beside `path` that no other attempt uses (PublishTemporaryName, created
  // exclusively), synced when `sync`, then RenameNoReplace (kCreateOnly) or Rename
  // (kReplace) into place, then SyncDir of the parent when `sync`. A temporary name removed
  // by someone else before the rename (another save's cleanup of what looked like a dead
  // attempt's leftover) is retried with a fresh name; any other failure removes the
  // temporary file. A wrapper whose Publish calls this sees every step through its own
  // overrides (FaultInjectingStorage does, so that a crash can hit each step).
  Status PublishThroughRename(const std::string& path, std::span<const std::byte> bytes,
                              PublishMode mode, bool sync);

  // Opens `path` for writing, created as `mode` says. The parent directory must exist. A new
  // directory entry is durable only after SyncDir(parent).
  virtual Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                CreateMode mode) = 0;
  // NewWritableFile(path, CreateMode::kExclusive): a new file, never an existing name.
  // (Implementations add `using Storage::NewWritableFile;` to keep this overload visible.)
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) {
    return NewWritableFile(path, CreateMode::kExclusive);
  }
  // kNotFound when `path` does not exist.
  virtual Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) = 0;
  // NewReadableFile for a caller that reads the file's first bytes next (a data file's header,
  // a manifest read whole): the store may fetch up to `prefix_bytes` of them with the open and
  // serve reads that lie within them from memory. Where an open is a request of its own (S3: a
  // HEAD for the size), one ranged GET then opens the file and reads its head. The file is
  // otherwise what NewReadableFile returns, errors included. The default calls
  // NewReadableFile and fetches nothing early; StorageWrapper does not forward it, so that a
  // wrapper's own NewReadableFile sees every open.
  virtual Result<std::unique_ptr<ReadableFile>> NewReadableFileWithPrefix(const std::string& path,
                                                                          size_t prefix_bytes) {
    (void)prefix_bytes;
    return NewReadableFile(path);
  }
  // Like `mkdir -p`. OK when the directory exists.
  virtual Status CreateDirs(const std::string& path) = 0;
  virtual Result<FileType> Stat(const std::string& path) = 0;
  // Whether `path` itself is a symbolic link (not followed; false when it does not exist). The
  // manager never deletes through a link: a step directory that is one may point anywhere. The
  // default is false: a store without links (memory, object stores).
  virtual Result<bool> IsSymlink(const std::string& path) {
    (void)path;
    return false;
  }
  // Names (not paths) of the entries of `dir`, sorted. kNotFound when `dir` does not exist.
  virtual Result<std::vector<std::string>> ListDir(const std::string& dir) = 0;
  // Atomically replaces `to` with `from`. Durable after SyncDir of the parent directory.
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  // Moves the file `from` to `to` atomically if `to` does not exist, else fails with
  // kAlreadyExists and changes nothing; of several racing calls for one `to`, exactly one
  // succeeds. Durable after SyncDir of the parent directory. What PublishThroughRename does
  // for kCreateOnly. The default returns kUnimplemented (a store without rename).
  virtual Status RenameNoReplace(const std::string& from, const std::string& to) {
    (void)to;
    return Unimplemented("RenameNoReplace is not supported for " + from);
  }
  // Removes a file. kNotFound when it does not exist.
  virtual Status Remove(const std::string& path) = 0;
  // Removes a file if it is there: OK when it does not exist (what a cleanup wants of a name it
  // listed, which a racing cleanup may have removed first). Never removes a directory. The
  // default calls Remove; an object store whose Remove must look before it deletes to report
  // kNotFound (S3: a HEAD) sends the DELETE alone. StorageWrapper does not forward it, so that
  // a wrapper's own Remove sees every removal.
  virtual Status RemoveIfPresent(const std::string& path) {
    Status removed = Remove(path);
    return removed.code() == StatusCode::kNotFound ? Status::Ok() : removed;
  }
  // Removes an empty directory (what a failed `tessera convert` does with its temporary
  // directory once it has removed the files in it). kNotFound when it does not exist; an
  // error naming the path when it is not empty or not a directory. The default returns
  // kUnimplemented (a Storage that cannot remove directories leaves them behind).
  virtual Status RemoveDir(const std::string& path) {
    return Unimplemented("RemoveDir is not supported for " + path);
  }
  // Makes the directory's entries (creations, renames, removals) durable (fsync of the dir).
  virtual Status SyncDir(const std::string& dir) = 0;
};

// Options of the POSIX implementation.
struct PosixStorageOptions {
  // Largest single pwrite/pread issued, in bytes; larger requests are split. Default 64 MiB:
  // big enough to stream at disk speed, small enough to stay interruptible.
  size_t max_io_bytes = 64u << 20;
  // ReadableFile::Map through mmap(2). Verify then hashes chunks where they lie in the page
  // cache instead of copying them first (1 GiB: 0.14-0.17 s against 0.21 s). Turn it off for
  // file systems where another process may shrink the files being read (see the contract of
  // Map).
  bool map_reads = true;
};

// Files on the local (or a shared) file system, through open/pread/pwrite/fdatasync/rename.
std::shared_ptr<Storage> NewPosixStorage(PosixStorageOptions options = {});

// Joins two path pieces with one '/'.
std::string JoinPath(const std::string& dir, const std::string& name);

// The temporary name PublishThroughRename writes `path` under:
// "<path>.tsr-tmp-<16 lowercase hex digits>", the digits from the kernel's random source.
std::string PublishTemporaryName(const std::string& path);
// Whether `name` (a file name, not a path) is such a temporary name; if so, sets *target to the
// name it was to be published as. Cleanups use it to remove what a killed Publish left.
bool ParsePublishTemporaryName(std::string_view name, std::string* target);

}  // namespace tessera

#endif  // TESSERA_STORAGE_H_
