// Storage on POSIX files: open/pread/pwrite/fdatasync/rename, with EINTR and short-transfer
// loops, requests split at PosixStorageOptions::max_io_bytes, and error messages that name
// the operation, the path and the errno text.
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {
namespace {

// "" means the current directory to the file system calls.
const char* OsPath(const std::string& path) { return path.empty() ? "." : path.c_str(); }

// close(2) without retrying on EINTR: on Linux the descriptor is released even then.
Status CloseFd(int fd, const std::string& path) {
  if (::close(fd) != 0 && errno != EINTR) return IOErrorFromErrno("close " + path, errno);
  return Status::Ok();
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd, size_t max_io_bytes)
      : path_(std::move(path)), fd_(fd), max_io_bytes_(max_io_bytes) {}
  ~PosixWritableFile() override { Close().IgnoreError(); }

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    const int fd = fd_.load(std::memory_order_acquire);
    if (fd < 0) return FailedPrecondition("write to " + path_ + ": file is closed");
    const auto* p = static_cast<const uint8_t*>(data);
    uint64_t pos = offset;
    size_t left = n;
    while (left > 0) {
      const size_t chunk = std::min(left, max_io_bytes_);
      const ssize_t r = ::pwrite(fd, p, chunk, static_cast<off_t>(pos));
      if (r < 0) {
        if (errno == EINTR) continue;
        return IOErrorFromErrno("pwrite " + path_ + " at offset " + std::to_string(pos) + " (" +
                                    std::to_string(chunk) + " bytes)",
                                errno);
      }
      if (r == 0) {
        return IOError("pwrite " + path_ + " at offset " + std::to_string(pos) +
                       ": wrote 0 bytes of " + std::to_string(chunk));
      }
      p += r;
      pos += static_cast<uint64_t>(r);
      left -= static_cast<size_t>(r);
    }
    return Status::Ok();
  }

  // sync_file_range(SYNC_FILE_RANGE_WRITE): queues the range's dirty pages for writeback and
  // returns. File systems that do not support it (EINVAL, ENOSYS, EOPNOTSUPP, ESPIPE) are not
  // an error: it is a hint, and Sync still makes everything durable.
  Status StartWriteback(uint64_t offset, uint64_t n) override {
    const int fd = fd_.load(std::memory_order_acquire);
    if (fd < 0) return FailedPrecondition("writeback of " + path_ + ": file is closed");
    while (::sync_file_range(fd, static_cast<off_t>(offset), static_cast<off_t>(n),
                             SYNC_FILE_RANGE_WRITE) != 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP || errno == ESPIPE) break;
      return IOErrorFromErrno("sync_file_range " + path_ + " at offset " + std::to_string(offset) +
                                  " (" + std::to_string(n) + " bytes)",
                              errno);
    }
    return Status::Ok();
  }

  // copy_file_range(2) when `src` is a PosixReadableFile (defined below), else the default.
  Status CopyFrom(const ReadableFile& src, uint64_t src_offset, uint64_t dst_offset,
                  uint64_t n) override;

  Status Sync() override {
    const int fd = fd_.load(std::memory_order_acquire);
    if (fd < 0) return FailedPrecondition("sync " + path_ + ": file is closed");
    while (::fdatasync(fd) != 0) {
      if (errno != EINTR) return IOErrorFromErrno("fdatasync " + path_, errno);
    }
    return Status::Ok();
  }

  Status Close() override {
    const int fd = fd_.exchange(-1, std::memory_order_acq_rel);
    if (fd < 0) return Status::Ok();
    return CloseFd(fd, path_);
  }

  const std::string& path() const override { return path_; }

 private:
  const std::string path_;
  std::atomic<int> fd_;
  const size_t max_io_bytes_;
};

class PosixReadableFile : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd, uint64_t size, const PosixStorageOptions& options)
      : path_(std::move(path)),
        fd_(fd),
        size_(size),
        max_io_bytes_(options.max_io_bytes),
        map_reads_(options.map_reads) {}
  ~PosixReadableFile() override { CloseFd(fd_, path_).IgnoreError(); }

  Status ReadAt(uint64_t offset, void* dst, size_t n) const override {
    TESSERA_RETURN_IF_ERROR(CheckRange(offset, n, "read"));
    auto* p = static_cast<uint8_t*>(dst);
    uint64_t pos = offset;
    size_t left = n;
    while (left > 0) {
      const size_t chunk = std::min(left, max_io_bytes_);
      const ssize_t r = ::pread(fd_, p, chunk, static_cast<off_t>(pos));
      if (r < 0) {
        if (errno == EINTR) continue;
        return IOErrorFromErrno("pread " + path_ + " at offset " + std::to_string(pos) + " (" +
                                    std::to_string(chunk) + " bytes)",
                                errno);
      }
      if (r == 0) {
        // The file shrank after it was opened.
        return DataLoss("read of " + path_ + " at offset " + std::to_string(offset) + " length " +
                        std::to_string(n) + " hit the end of the file at offset " +
                        std::to_string(pos) + " (size " + std::to_string(size_) +
                        " when opened; truncated?)");
      }
      p += r;
      pos += static_cast<uint64_t>(r);
      left -= static_cast<size_t>(r);
    }
    return Status::Ok();
  }

  // MAP_POPULATE: the pages are mapped in one call rather than faulted in one by one.
  Result<FileMapping> Map(uint64_t offset, size_t n) const override {
    if (!map_reads_) return Unimplemented("PosixStorageOptions::map_reads is off");
    TESSERA_RETURN_IF_ERROR(CheckRange(offset, n, "mapping"));
    if (n == 0) return FileMapping();
    // A file shrunk since it was opened would raise SIGBUS where the caller touches the
    // mapping past its new end: refuse here instead (the caller's ReadAt then reports it).
    struct stat st;
    if (::fstat(fd_, &st) != 0) return IOErrorFromErrno("fstat " + path_, errno);
    if (static_cast<uint64_t>(st.st_size) < offset + n) {
      return DataLoss("mapping of " + path_ + " at offset " + std::to_string(offset) + " length " +
                      std::to_string(n) + ": the file shrank to " + std::to_string(st.st_size) +
                      " bytes after it was opened (size " + std::to_string(size_) + ")");
    }
    static const uint64_t page_size = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t start = offset / page_size * page_size;
    const size_t length = n + static_cast<size_t>(offset - start);
    void* address = ::mmap(nullptr, length, PROT_READ, MAP_SHARED | MAP_POPULATE, fd_,
                           static_cast<off_t>(start));
    if (address == MAP_FAILED) {
      return IOErrorFromErrno("mmap " + path_ + " at offset " + std::to_string(offset) + " (" +
                                  std::to_string(n) + " bytes)",
                              errno);
    }
    return FileMapping(
        std::span<const std::byte>(static_cast<const std::byte*>(address) + (offset - start), n),
        [address, length] { ::munmap(address, length); });
  }

  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }
  int fd() const { return fd_; }

  // kDataLoss naming the path when [offset, offset + n) is not inside the file as opened.
  Status CheckRange(uint64_t offset, uint64_t n, const char* what) const {
    if (offset <= size_ && n <= size_ - offset) return Status::Ok();
    return DataLoss(std::string(what) + " of " + path_ + " at offset " + std::to_string(offset) +
                    " length " + std::to_string(n) + " is past the end of the file (size " +
                    std::to_string(size_) + "; truncated?)");
  }

  const std::string path_;
  const int fd_;
  const uint64_t size_;
  const size_t max_io_bytes_;
  const bool map_reads_;
};

// In the kernel, page cache to page cache (one copy, no user buffer), in calls of at most
// max_io_bytes. Where the kernel cannot copy between these two files (EXDEV: different file
// systems on older kernels; EINVAL, ENOSYS, EOPNOTSUPP: not supported), the rest goes
// through the default's buffer. A call that copies nothing means the source ended early (it
// shrank after it was opened), or a file system that copies nothing this way: the default's
// ReadAt then copies the rest or reports the truncation.
Status PosixWritableFile::CopyFrom(const ReadableFile& src, uint64_t src_offset,
                                   uint64_t dst_offset, uint64_t n) {
  const auto* posix = dynamic_cast<const PosixReadableFile*>(&src);
  if (posix == nullptr) return WritableFile::CopyFrom(src, src_offset, dst_offset, n);
  const int fd = fd_.load(std::memory_order_acquire);
  if (fd < 0) return FailedPrecondition("copy into " + path_ + ": file is closed");
  TESSERA_RETURN_IF_ERROR(posix->CheckRange(src_offset, n, "copy"));
  loff_t in = static_cast<loff_t>(src_offset), out = static_cast<loff_t>(dst_offset);
  uint64_t left = n;
  while (left > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(left, max_io_bytes_));
    const ssize_t r = ::copy_file_range(posix->fd(), &in, fd, &out, chunk, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno != EXDEV && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) {
      return IOErrorFromErrno("copy_file_range from " + src.path() + " at offset " +
                                  std::to_string(in) + " to " + path_ + " at offset " +
                                  std::to_string(out) + " (" + std::to_string(chunk) + " bytes)",
                              errno);
    }
    if (r <= 0) {
      return WritableFile::CopyFrom(src, static_cast<uint64_t>(in), static_cast<uint64_t>(out),
                                    left);
    }
    left -= static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

// open(2), retried on EINTR.
int OpenRetry(const std::string& path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(OsPath(path), flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

class PosixStorage : public Storage {
 public:
  explicit PosixStorage(PosixStorageOptions options) : options_(options) {
    if (options_.max_io_bytes == 0) options_.max_io_bytes = PosixStorageOptions().max_io_bytes;
  }

  // Every capability: rename(2) and renameat2(RENAME_NOREPLACE) (or link), pwrite, fsync of
  // directories, O_EXCL creation (Publish is Storage's, through RenameNoReplace).
  StorageCapabilities capabilities() const override {
    return StorageCapabilities{.rename = true,
                               .positional_writes = true,
                               .directory_sync = true,
                               .conditional_create = true};
  }

  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override {
    // O_EXCL alone already refuses a symbolic link (even a dangling one); O_NOFOLLOW says so.
    const bool exclusive = mode != CreateMode::kTruncate;
    const int how = exclusive ? O_CREAT | O_EXCL | O_NOFOLLOW : O_CREAT | O_TRUNC;
    const int fd = OpenRetry(path, O_WRONLY | how | O_CLOEXEC, 0644);
    if (fd < 0) {
      return StatusFromErrno("open " + path + " for writing" + (exclusive ? " as a new file" : ""),
                             errno);
    }
    return std::unique_ptr<WritableFile>(
        std::make_unique<PosixWritableFile>(path, fd, options_.max_io_bytes));
  }

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    const int fd = OpenRetry(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return StatusFromErrno("open " + path + " for reading", errno);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      CloseFd(fd, path).IgnoreError();
      return IOErrorFromErrno("fstat " + path, err);
    }
    if (S_ISDIR(st.st_mode)) {
      CloseFd(fd, path).IgnoreError();
      return IOErrorFromErrno("open " + path + " for reading", EISDIR);
    }
    return std::unique_ptr<ReadableFile>(
        std::make_unique<PosixReadableFile>(path, fd, static_cast<uint64_t>(st.st_size), options_));
  }

  Status CreateDirs(const std::string& path) override {
    // mkdir every prefix that ends before a '/', then the whole path.
    std::string prefix;
    prefix.reserve(path.size());
    for (size_t i = 0; i <= path.size(); ++i) {
      if (i < path.size() && path[i] != '/') {
        prefix.push_back(path[i]);
        continue;
      }
      // A '/' or the end: `prefix` names a directory unless it is empty or ends in '/'.
      const bool names_dir = !prefix.empty() && prefix.back() != '/';
      if (names_dir) TESSERA_RETURN_IF_ERROR(MkdirOne(prefix));
      if (i < path.size() && (prefix.empty() || names_dir)) prefix.push_back('/');
    }
    return Status::Ok();
  }

  Result<FileType> Stat(const std::string& path) override {
    struct stat st;
    if (::stat(OsPath(path), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return FileType::kNotFound;
      return IOErrorFromErrno("stat " + path, errno);
    }
    return S_ISDIR(st.st_mode) ? FileType::kDirectory : FileType::kFile;
  }

  Result<bool> IsSymlink(const std::string& path) override {
    struct stat st;
    if (::lstat(OsPath(path), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return false;
      return IOErrorFromErrno("lstat " + path, errno);
    }
    return S_ISLNK(st.st_mode);
  }

  Result<std::vector<std::string>> ListDir(const std::string& dir) override {
    DIR* d = ::opendir(OsPath(dir));
    if (d == nullptr) return StatusFromErrno("opendir " + dir, errno);
    std::vector<std::string> names;
    while (true) {
      errno = 0;
      const struct dirent* e = ::readdir(d);
      if (e == nullptr) {
        const int err = errno;
        ::closedir(d);
        if (err != 0) return IOErrorFromErrno("readdir " + dir, err);
        break;
      }
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      names.emplace_back(e->d_name);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(OsPath(from), OsPath(to)) != 0) {
      return StatusFromErrno("rename " + from + " to " + to, errno);
    }
    return Status::Ok();
  }

  // renameat2(RENAME_NOREPLACE); where the file system refuses it (EINVAL: not supported by
  // this file system, e.g. older NFS; ENOSYS: an old kernel), link(2) then unlink(2) of the
  // old name, which fails on an existing target the same way (the old name left behind by a
  // failed unlink is a temporary the next cleanup removes).
  Status RenameNoReplace(const std::string& from, const std::string& to) override {
    const std::string what = "rename " + from + " to " + to + " without replacing";
    if (::renameat2(AT_FDCWD, OsPath(from), AT_FDCWD, OsPath(to), RENAME_NOREPLACE) == 0) {
      return Status::Ok();
    }
    const int err = errno;
    if (err != EINVAL && err != ENOSYS && err != EOPNOTSUPP) return StatusFromErrno(what, err);
    if (::link(OsPath(from), OsPath(to)) != 0) {
      const int link_err = errno;
      if (link_err == EEXIST || link_err == ENOENT) return StatusFromErrno(what, link_err);
      return IOError(what + ": the file system supports neither renameat2(RENAME_NOREPLACE) (" +
                     std::strerror(err) + ") nor link(2) (" + std::strerror(link_err) + ")");
    }
    ::unlink(OsPath(from));
    return Status::Ok();
  }

  Status Remove(const std::string& path) override {
    if (::unlink(OsPath(path)) != 0) return StatusFromErrno("unlink " + path, errno);
    return Status::Ok();
  }

  Status RemoveDir(const std::string& path) override {
    if (::rmdir(OsPath(path)) != 0) return StatusFromErrno("rmdir " + path, errno);
    return Status::Ok();
  }

  Status SyncDir(const std::string& dir) override {
    const int fd = OpenRetry(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return StatusFromErrno("open directory " + dir, errno);
    Status status;
    while (::fsync(fd) != 0) {
      if (errno != EINTR) {
        status = IOErrorFromErrno("fsync directory " + dir, errno);
        break;
      }
    }
    Status closed = CloseFd(fd, dir);
    return status.ok() ? closed : status;
  }

 private:
  static Status MkdirOne(const std::string& dir) {
    if (::mkdir(dir.c_str(), 0755) == 0) return Status::Ok();
    const int err = errno;
    // An existing directory is fine whatever the error (EEXIST, or EACCES/EROFS on a parent
    // the caller may not write to).
    struct stat st;
    if (::stat(dir.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) return Status::Ok();
      return IOErrorFromErrno("mkdir " + dir + " (exists and is not a directory)", EEXIST);
    }
    return StatusFromErrno("mkdir " + dir, err);
  }

  PosixStorageOptions options_;
};

}  // namespace

std::shared_ptr<Storage> NewPosixStorage(PosixStorageOptions options) {
  return std::make_shared<PosixStorage>(options);
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  size_t name_begin = 0;
  while (name_begin < name.size() && name[name_begin] == '/') ++name_begin;
  if (name_begin == name.size()) return dir;
  size_t dir_end = dir.size();
  while (dir_end > 0 && dir[dir_end - 1] == '/') --dir_end;
  std::string out;
  out.reserve(dir_end + 1 + name.size() - name_begin);
  out.append(dir, 0, dir_end);
  out.push_back('/');
  out.append(name, name_begin, std::string::npos);
  return out;
}

}  // namespace tessera
