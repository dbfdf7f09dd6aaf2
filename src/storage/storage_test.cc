// One suite for every Storage (posix, memory, fault-injecting with no fault planned, S3 on moto's
// server), its cases instantiated by capability, then MemoryStorage's crash model and
// FaultInjectingStorage's fault plans.
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#if TESSERA_HAVE_S3
#include "storage/s3/s3_client.h"
#include "storage/s3/testing/moto_server.h"
#include "tessera/s3_storage.h"
#endif
#include "tessera/fault_injecting_storage.h"
#include "tessera/memory_storage.h"
#include "tessera/status.h"
#include "tessera/storage.h"
#include "tessera/storage_wrapper.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

// Each evaluates its argument once.
#define STORAGE_EXPECT_OK(expr)                             \
  do {                                                      \
    const Status _s = ::tessera::internal::GetStatus(expr); \
    EXPECT_TRUE(_s.ok()) << #expr << ": " << _s.ToString(); \
  } while (0)
#define STORAGE_ASSERT_OK(expr)                             \
  do {                                                      \
    const Status _s = ::tessera::internal::GetStatus(expr); \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s.ToString(); \
  } while (0)
#define STORAGE_ASSIGN_OR_FAIL_IMPL(tmp, lhs, expr)                  \
  auto tmp = (expr);                                                 \
  ASSERT_TRUE(tmp.ok()) << #expr << ": " << tmp.status().ToString(); \
  lhs = std::move(tmp).value()
#define STORAGE_ASSIGN_OR_FAIL(lhs, expr) \
  STORAGE_ASSIGN_OR_FAIL_IMPL(TESSERA_CONCAT(_storage_test_result_, __LINE__), lhs, expr)

constexpr CreateMode kExclusiveMode = CreateMode::kExclusive;

// Small enough that the large-write test crosses it many times, and not a power of two.
constexpr size_t kPosixMaxIoBytes = 4000;

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

std::vector<uint8_t> Bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

Status WriteFile(Storage& storage, const std::string& path, const std::string& contents,
                 CreateMode mode = CreateMode::kExclusive) {
  TESSERA_ASSIGN_OR_RETURN(auto file, storage.NewWritableFile(path, mode));
  TESSERA_RETURN_IF_ERROR(file->WriteAt(0, contents.data(), contents.size()));
  TESSERA_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

Result<std::string> ReadFile(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(auto file, storage.NewReadableFile(path));
  std::string out(file->size(), '\0');
  TESSERA_RETURN_IF_ERROR(file->ReadAt(0, out.data(), out.size()));
  return out;
}

// ---- the shared suite ----------------------------------------------------------------------

// A storage and a directory in it that a test may fill.
class StorageEnv {
 public:
  virtual ~StorageEnv() = default;
  virtual bool ok() const { return true; }
  virtual Storage& storage() = 0;
  const std::string& root() const { return root_; }

 protected:
  std::string root_;
};

class PosixEnv : public StorageEnv {
 public:
  PosixEnv() {
    char tmpl[] = "/tmp/tessera_storage_test_XXXXXX";
    const char* dir = ::mkdtemp(tmpl);
    if (dir == nullptr) ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
    root_ = dir ? dir : "/nonexistent";
    storage_ = NewPosixStorage(PosixStorageOptions{.max_io_bytes = kPosixMaxIoBytes});
  }
  ~PosixEnv() override {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
    EXPECT_FALSE(ec) << "removing " << root_ << ": " << ec.message();
  }
  Storage& storage() override { return *storage_; }

 private:
  std::shared_ptr<Storage> storage_;
};

class MemoryEnv : public StorageEnv {
 public:
  MemoryEnv() {
    root_ = "/mem/test";
    EXPECT_TRUE(storage_.CreateDirs(root_).ok());
  }
  Storage& storage() override { return storage_; }

 private:
  MemoryStorage storage_;
};

class FaultInjectingEnv : public StorageEnv {
 public:
  FaultInjectingEnv() : memory_(std::make_shared<MemoryStorage>()), storage_(memory_, FaultPlan{}) {
    root_ = "/fault/test";
    EXPECT_TRUE(storage_.CreateDirs(root_).ok());
  }
  ~FaultInjectingEnv() override {
    EXPECT_FALSE(storage_.fault_fired());
    EXPECT_GT(storage_.operation_count(), 0);
  }
  Storage& storage() override { return storage_; }

 private:
  std::shared_ptr<MemoryStorage> memory_;
  FaultInjectingStorage storage_;
};

#if TESSERA_HAVE_S3
// An S3Storage on moto's server (started by the test, signatures enforced), rooted at a key
// prefix of its own. Every test must leave no multipart upload behind.
class S3Env : public StorageEnv {
 public:
  S3Env() {
    Result<s3::testing::MotoServer*> server = s3::testing::SharedMotoServer();
    if (!server.ok()) {
      // Loud: the S3 cases fail, they never skip.
      ADD_FAILURE() << "could not start the S3 test server: " << server.status().ToString();
      return;
    }
    Result<std::shared_ptr<s3::S3Client>> client = s3::S3Client::Create((*server)->ClientOptions());
    if (!client.ok()) {
      ADD_FAILURE() << client.status().ToString();
      return;
    }
    storage_ = std::make_shared<S3Storage>(*client, (*server)->bucket());
    root_ = s3::testing::UniquePrefix();
  }
  ~S3Env() override {
    if (!storage_) return;
    Result<std::vector<s3::UploadListing::Upload>> uploads =
        storage_->client().ListMultipartUploads(storage_->bucket(), root_ + "/");
    EXPECT_TRUE(uploads.ok() && uploads->empty())
        << "multipart uploads left behind under " << root_;
  }
  bool ok() const override { return storage_ != nullptr; }
  Storage& storage() override { return *storage_; }

 private:
  std::shared_ptr<S3Storage> storage_;
};
#endif  // TESSERA_HAVE_S3

struct StorageKind {
  std::string name;
  std::function<std::unique_ptr<StorageEnv>()> make;
  // What the storage claims (checked against capabilities() in SetUp): the cases that need
  // more are not instantiated for it.
  StorageCapabilities capabilities;
};
void PrintTo(const StorageKind& kind, std::ostream* os) { *os << kind.name; }

class StorageTest : public ::testing::TestWithParam<StorageKind> {
 protected:
  void SetUp() override {
    env_ = GetParam().make();
    ASSERT_TRUE(env_->ok()) << GetParam().name << " storage could not be set up";
    const StorageCapabilities want = GetParam().capabilities;
    const StorageCapabilities got = storage().capabilities();
    ASSERT_TRUE(want.rename == got.rename && want.positional_writes == got.positional_writes &&
                want.directory_sync == got.directory_sync &&
                want.conditional_create == got.conditional_create)
        << GetParam().name << ": capabilities() differ from what the suite selects cases by";
  }
  void TearDown() override { env_.reset(); }

  Storage& storage() { return env_->storage(); }
  std::string Path(const std::string& name) const { return JoinPath(env_->root(), name); }

  std::unique_ptr<StorageEnv> env_;
};

// Cases that need more than reading and writing whole files front to back, instantiated for
// the storages whose capabilities() say they have it:
//   positional_writes  WriteAt at any offset, in any order, into a file that exists in place
//                      while it is written (readers see it; removing it keeps it open)
//   rename             Rename
//   directory_sync     directories that exist by themselves (empty ones too), a parent that
//                      must exist, SyncDir that checks what it syncs
//   conditional_create Publish
class PositionalWritesStorageTest : public StorageTest {};
class RenameStorageTest : public StorageTest {};
class DirectoryStorageTest : public StorageTest {};
class PublishStorageTest : public StorageTest {};

TEST_P(PositionalWritesStorageTest, WriteReadRoundTripAtOffsets) {
  const std::string path = Path("f");
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  EXPECT_EQ(w->path(), path);
  STORAGE_ASSERT_OK(w->WriteAt(0, "hello ", 6));
  STORAGE_ASSERT_OK(w->WriteAt(6, "world", 5));
  STORAGE_ASSERT_OK(w->WriteAt(0, "J", 1));  // overwrite in place
  STORAGE_ASSERT_OK(w->Sync());
  STORAGE_ASSERT_OK(w->Close());

  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  EXPECT_EQ(r->path(), path);
  ASSERT_EQ(r->size(), 11u);
  char buf[16] = {};
  STORAGE_ASSERT_OK(r->ReadAt(0, buf, 11));
  EXPECT_EQ(std::string(buf, 11), "Jello world");
  STORAGE_ASSERT_OK(r->ReadAt(6, buf, 5));
  EXPECT_EQ(std::string(buf, 5), "world");
  STORAGE_ASSERT_OK(r->ReadAt(3, buf, 4));
  EXPECT_EQ(std::string(buf, 4), "lo w");
}

TEST_P(StorageTest, LargeWriteAndReadCrossMaxIoBytes) {
  // Many times kPosixMaxIoBytes, at an offset that is not a multiple of it.
  const std::vector<uint8_t> data = Pattern(25 * kPosixMaxIoBytes + 123, 7);
  const uint64_t offset = 1001;
  const std::string path = Path("large");
  {
    STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
    STORAGE_ASSERT_OK(w->WriteAt(0, data.data(), offset));  // some prefix
    STORAGE_ASSERT_OK(w->WriteAt(offset, data.data(), data.size()));
    STORAGE_ASSERT_OK(w->Close());
  }
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  ASSERT_EQ(r->size(), offset + data.size());
  std::vector<uint8_t> back(data.size());
  STORAGE_ASSERT_OK(r->ReadAt(offset, back.data(), back.size()));
  EXPECT_TRUE(back == data) << "large read differs";
  // A read that straddles several max_io_bytes boundaries at odd offsets.
  const size_t mid = 3 * kPosixMaxIoBytes - 17;
  std::vector<uint8_t> part(5 * kPosixMaxIoBytes + 3);
  STORAGE_ASSERT_OK(r->ReadAt(offset + mid, part.data(), part.size()));
  EXPECT_TRUE(std::equal(part.begin(), part.end(), data.begin() + mid));
}

TEST_P(PositionalWritesStorageTest, SparseOutOfOrderWritesZeroFillGaps) {
  const std::string path = Path("sparse");
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  STORAGE_ASSERT_OK(w->WriteAt(100, "tail", 4));
  STORAGE_ASSERT_OK(w->WriteAt(10, "mid", 3));
  STORAGE_ASSERT_OK(w->WriteAt(0, "head", 4));
  STORAGE_ASSERT_OK(w->Close());
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  std::string want(104, '\0');
  want.replace(0, 4, "head");
  want.replace(10, 3, "mid");
  want.replace(100, 4, "tail");
  EXPECT_EQ(got, want);
}

TEST_P(StorageTest, ReadPastEndIsDataLossNamingPathAndSize) {
  const std::string path = Path("short");
  STORAGE_ASSERT_OK(WriteFile(storage(), path, "0123456789"));
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  char buf[32];
  const Status s = r->ReadAt(5, buf, 10);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr("offset 5"));
  EXPECT_THAT(s.message(), HasSubstr("length 10"));
  EXPECT_THAT(s.message(), HasSubstr("size 10"));
  EXPECT_THAT(s.message(), HasSubstr("truncated?"));
  // Offsets near 2^64 must not wrap around.
  EXPECT_EQ(r->ReadAt(~uint64_t{0} - 2, buf, 8).code(), StatusCode::kDataLoss);
  EXPECT_EQ(r->ReadAt(11, buf, 0).code(), StatusCode::kDataLoss);
  // Up to the end is fine, including an empty read there.
  STORAGE_EXPECT_OK(r->ReadAt(0, buf, 10));
  STORAGE_EXPECT_OK(r->ReadAt(10, buf, 0));
}

TEST_P(PositionalWritesStorageTest, ReaderSizeIsSizeAtOpen) {
  const std::string path = Path("grows");
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  STORAGE_ASSERT_OK(w->WriteAt(0, "abcd", 4));
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  STORAGE_ASSERT_OK(w->WriteAt(4, "efgh", 4));
  EXPECT_EQ(r->size(), 4u);
  char buf[8];
  EXPECT_EQ(r->ReadAt(0, buf, 8).code(), StatusCode::kDataLoss);
  STORAGE_ASSIGN_OR_FAIL(auto r2, storage().NewReadableFile(path));
  EXPECT_EQ(r2->size(), 8u);
}

TEST_P(PositionalWritesStorageTest, ReadOfFileTruncatedAfterOpenIsDataLoss) {
  const std::string path = Path("trunc");
  STORAGE_ASSERT_OK(WriteFile(storage(), path, std::string(100, 'x')));
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path, CreateMode::kTruncate));
  char buf[10];
  const Status s = r->ReadAt(50, buf, 10);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr(path));
}

// Mapping a file that shrank after it was opened is an error, never a mapping past its end
// (whose pages would raise SIGBUS when touched).
TEST_P(StorageTest, MapOfFileTruncatedAfterOpenFails) {
  const std::string path = Path("shrinks");
  STORAGE_ASSERT_OK(WriteFile(storage(), path, std::string(3 << 20, 'x')));
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path, CreateMode::kTruncate));
  const Result<FileMapping> m = r->Map(1 << 20, 1 << 20);
  ASSERT_FALSE(m.ok());
  if (m.status().code() == StatusCode::kUnimplemented) return;
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss) << m.status().ToString();
  EXPECT_THAT(m.status().message(), HasSubstr("shrank to 0 bytes"));
  EXPECT_THAT(m.status().message(), HasSubstr(path));
}

TEST_P(StorageTest, TruncateModeTruncatesExistingFile) {
  const std::string path = Path("t");
  STORAGE_ASSERT_OK(WriteFile(storage(), path, "long old contents"));
  STORAGE_ASSERT_OK(WriteFile(storage(), path, "new", CreateMode::kTruncate));
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "new");
}

// Issue 11, item 5: the default, exclusive creation, refuses every name that exists: an error
// naming it, and the existing file untouched.
TEST_P(StorageTest, ExclusiveCreateRefusesAnExistingFile) {
  const std::string path = Path("taken");
  STORAGE_ASSERT_OK(WriteFile(storage(), path, "precious"));
  for (const CreateMode* mode : {static_cast<const CreateMode*>(nullptr), &kExclusiveMode}) {
    auto w = mode ? storage().NewWritableFile(path, *mode) : storage().NewWritableFile(path);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), StatusCode::kAlreadyExists) << w.status().ToString();
    EXPECT_THAT(w.status().message(), HasSubstr(path));
  }
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "precious");
}

TEST_P(DirectoryStorageTest, ExclusiveCreateRefusesADirectory) {
  const std::string dir = Path("dir");
  STORAGE_ASSERT_OK(storage().CreateDirs(dir));
  auto w = storage().NewWritableFile(dir);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kAlreadyExists) << w.status().ToString();
  STORAGE_ASSIGN_OR_FAIL(FileType type, storage().Stat(dir));
  EXPECT_EQ(type, FileType::kDirectory);
}

TEST_P(DirectoryStorageTest, MissingPathsAreNotFound) {
  const std::string missing = Path("missing");
  auto r = storage().NewReadableFile(missing);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
  EXPECT_THAT(r.status().message(), HasSubstr(missing));
  EXPECT_THAT(r.status().message(), HasSubstr(std::strerror(ENOENT)));

  const std::string in_missing_dir = Path("nodir/x");
  auto w = storage().NewWritableFile(in_missing_dir);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound) << w.status().ToString();
  EXPECT_THAT(w.status().message(), HasSubstr(in_missing_dir));

  const Status removed = storage().Remove(missing);
  EXPECT_EQ(removed.code(), StatusCode::kNotFound) << removed.ToString();
  EXPECT_THAT(removed.message(), HasSubstr(missing));

  const Status renamed = storage().Rename(missing, Path("other"));
  EXPECT_EQ(renamed.code(), StatusCode::kNotFound) << renamed.ToString();
  EXPECT_THAT(renamed.message(), HasSubstr(missing));

  auto listed = storage().ListDir(missing);
  ASSERT_FALSE(listed.ok());
  EXPECT_EQ(listed.status().code(), StatusCode::kNotFound) << listed.status().ToString();
  EXPECT_THAT(listed.status().message(), HasSubstr(missing));

  EXPECT_EQ(storage().SyncDir(missing).code(), StatusCode::kNotFound);
}

TEST_P(DirectoryStorageTest, CreateDirsIsNestedAndIdempotent) {
  const std::string deep = Path("a/b/c");
  STORAGE_ASSERT_OK(storage().CreateDirs(deep));
  STORAGE_ASSERT_OK(storage().CreateDirs(deep));
  STORAGE_ASSERT_OK(storage().CreateDirs(Path("a/b")));
  STORAGE_ASSERT_OK(storage().CreateDirs(Path("a/b/c/")));
  for (const char* d : {"a", "a/b", "a/b/c"}) {
    STORAGE_ASSIGN_OR_FAIL(FileType type, storage().Stat(Path(d)));
    EXPECT_EQ(type, FileType::kDirectory) << d;
  }
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("a/b/c/f"), "x"));
  STORAGE_ASSIGN_OR_FAIL(auto names, storage().ListDir(Path("a")));
  EXPECT_THAT(names, ElementsAre("b"));
  STORAGE_ASSIGN_OR_FAIL(auto empty, storage().ListDir(Path("a/b/c/")));
  EXPECT_THAT(empty, ElementsAre("f"));
}

TEST_P(DirectoryStorageTest, CreateDirsThroughAFileFails) {
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("file"), "x"));
  const Status over = storage().CreateDirs(Path("file"));
  EXPECT_EQ(over.code(), StatusCode::kIOError) << over.ToString();
  EXPECT_THAT(over.message(), HasSubstr(Path("file")));
  EXPECT_FALSE(storage().CreateDirs(Path("file/sub")).ok());
}

TEST_P(StorageTest, StatReportsTheType) {
  STORAGE_ASSERT_OK(storage().CreateDirs(Path("d")));
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("d/f"), "x"));
  STORAGE_ASSIGN_OR_FAIL(FileType file, storage().Stat(Path("d/f")));
  EXPECT_EQ(file, FileType::kFile);
  STORAGE_ASSIGN_OR_FAIL(FileType dir, storage().Stat(Path("d")));
  EXPECT_EQ(dir, FileType::kDirectory);
  STORAGE_ASSIGN_OR_FAIL(FileType missing, storage().Stat(Path("d/nope")));
  EXPECT_EQ(missing, FileType::kNotFound);
  STORAGE_ASSIGN_OR_FAIL(FileType under_file, storage().Stat(Path("d/f/g")));
  EXPECT_EQ(under_file, FileType::kNotFound);
}

TEST_P(StorageTest, ListDirIsSortedWithoutDotEntries) {
  STORAGE_ASSIGN_OR_FAIL(auto none, storage().ListDir(env_->root()));
  EXPECT_THAT(none, IsEmpty());
  for (const char* name : {"c2", "b", "c10", "a", "B"}) {
    STORAGE_ASSERT_OK(WriteFile(storage(), Path(name), name));
  }
  STORAGE_ASSERT_OK(storage().CreateDirs(Path("d")));
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("d/in"), "x"));  // a directory everywhere
  STORAGE_ASSIGN_OR_FAIL(auto names, storage().ListDir(env_->root()));
  EXPECT_THAT(names, ElementsAre("B", "a", "b", "c10", "c2", "d"));
  // A file is not a directory.
  auto of_file = storage().ListDir(Path("a"));
  ASSERT_FALSE(of_file.ok());
  EXPECT_EQ(of_file.status().code(), StatusCode::kIOError) << of_file.status().ToString();
}

TEST_P(RenameStorageTest, RenameReplacesTheTarget) {
  const std::string target = Path("manifest");
  const std::string tmp = Path("manifest.tmp");
  STORAGE_ASSERT_OK(WriteFile(storage(), target, "old"));
  STORAGE_ASSERT_OK(WriteFile(storage(), tmp, "new contents"));
  STORAGE_ASSERT_OK(storage().Rename(tmp, target));
  STORAGE_ASSERT_OK(storage().SyncDir(env_->root()));
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), target));
  EXPECT_EQ(got, "new contents");
  STORAGE_ASSIGN_OR_FAIL(FileType tmp_type, storage().Stat(tmp));
  EXPECT_EQ(tmp_type, FileType::kNotFound);
  STORAGE_ASSIGN_OR_FAIL(auto names, storage().ListDir(env_->root()));
  EXPECT_THAT(names, ElementsAre("manifest"));
}

TEST_P(RenameStorageTest, RenameMovesADirectoryWithItsContents) {
  STORAGE_ASSERT_OK(storage().CreateDirs(Path("src/sub")));
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("src/sub/f"), "payload"));
  STORAGE_ASSERT_OK(storage().Rename(Path("src"), Path("dst")));
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), Path("dst/sub/f")));
  EXPECT_EQ(got, "payload");
  STORAGE_ASSIGN_OR_FAIL(FileType old_type, storage().Stat(Path("src")));
  EXPECT_EQ(old_type, FileType::kNotFound);
}

TEST_P(StorageTest, RemoveDeletesAFileButNotADirectory) {
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("gone"), "x"));
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("kept"), "y"));
  STORAGE_ASSERT_OK(storage().Remove(Path("gone")));
  STORAGE_ASSIGN_OR_FAIL(FileType type, storage().Stat(Path("gone")));
  EXPECT_EQ(type, FileType::kNotFound);
  STORAGE_ASSIGN_OR_FAIL(auto names, storage().ListDir(env_->root()));
  EXPECT_THAT(names, ElementsAre("kept"));
  EXPECT_EQ(storage().Remove(Path("gone")).code(), StatusCode::kNotFound);

  STORAGE_ASSERT_OK(storage().CreateDirs(Path("dir")));
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("dir/f"), "z"));  // a directory everywhere
  EXPECT_EQ(storage().Remove(Path("dir")).code(), StatusCode::kIOError);
}

TEST_P(DirectoryStorageTest, RemoveDirRemovesOnlyAnEmptyDirectory) {
  STORAGE_ASSERT_OK(storage().CreateDirs(Path("full")));
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("full/f"), "x"));
  const Status not_empty = storage().RemoveDir(Path("full"));
  EXPECT_EQ(not_empty.code(), StatusCode::kIOError);
  EXPECT_NE(not_empty.message().find(Path("full")), std::string::npos) << not_empty.ToString();
  EXPECT_EQ(storage().RemoveDir(Path("full/f")).code(), StatusCode::kIOError);  // a file
  STORAGE_ASSERT_OK(storage().Remove(Path("full/f")));
  STORAGE_ASSERT_OK(storage().RemoveDir(Path("full")));
  STORAGE_ASSIGN_OR_FAIL(FileType type, storage().Stat(Path("full")));
  EXPECT_EQ(type, FileType::kNotFound);
  EXPECT_EQ(storage().RemoveDir(Path("full")).code(), StatusCode::kNotFound);
}

TEST_P(StorageTest, DuplicateSlashesAndDotsNameTheSameFile) {
  STORAGE_ASSERT_OK(storage().CreateDirs(Path("d")));
  STORAGE_ASSERT_OK(WriteFile(storage(), env_->root() + "/d//x", "same"));
  for (const std::string& alias : {Path("d/x"), env_->root() + "//d/./x"}) {
    STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), alias));
    EXPECT_EQ(got, "same") << alias;
  }
  STORAGE_ASSIGN_OR_FAIL(auto names, storage().ListDir(Path("d/")));
  EXPECT_THAT(names, ElementsAre("x"));
}

TEST_P(RenameStorageTest, OpenWritableFileFollowsItsInodeAcrossRename) {
  const std::string tmp = Path("f.tmp");
  const std::string final_path = Path("f");
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(tmp));
  STORAGE_ASSERT_OK(w->WriteAt(0, "abc", 3));
  STORAGE_ASSERT_OK(storage().Rename(tmp, final_path));
  STORAGE_ASSERT_OK(w->WriteAt(3, "def", 3));
  STORAGE_ASSERT_OK(w->Sync());
  STORAGE_ASSERT_OK(w->Close());
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), final_path));
  EXPECT_EQ(got, "abcdef");
  STORAGE_ASSIGN_OR_FAIL(FileType tmp_type, storage().Stat(tmp));
  EXPECT_EQ(tmp_type, FileType::kNotFound);
}

TEST_P(PositionalWritesStorageTest, OpenFilesKeepWorkingAfterRemove) {
  const std::string path = Path("unlinked");
  STORAGE_ASSERT_OK(WriteFile(storage(), path, "still here"));
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(Path("w")));
  STORAGE_ASSERT_OK(storage().Remove(path));
  STORAGE_ASSERT_OK(storage().Remove(Path("w")));
  char buf[10];
  STORAGE_ASSERT_OK(r->ReadAt(0, buf, 10));
  EXPECT_EQ(std::string(buf, 10), "still here");
  STORAGE_EXPECT_OK(w->WriteAt(0, "x", 1));
  STORAGE_EXPECT_OK(w->Sync());
}

TEST_P(StorageTest, CloseIsIdempotentAndLaterWritesFail) {
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(Path("c")));
  STORAGE_ASSERT_OK(w->WriteAt(0, "x", 1));
  STORAGE_ASSERT_OK(w->Close());
  STORAGE_ASSERT_OK(w->Close());
  const Status write = w->WriteAt(1, "y", 1);
  EXPECT_FALSE(write.ok());
  EXPECT_THAT(write.message(), HasSubstr(Path("c")));
  EXPECT_FALSE(w->Sync().ok());
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), Path("c")));
  EXPECT_EQ(got, "x");
}

TEST_P(DirectoryStorageTest, SyncDirOfAFileFails) {
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("f"), "x"));
  STORAGE_EXPECT_OK(storage().SyncDir(env_->root()));
  EXPECT_EQ(storage().SyncDir(Path("f")).code(), StatusCode::kIOError);
}

TEST_P(PositionalWritesStorageTest, ConcurrentWriteAtOfDisjointRanges) {
  constexpr int kThreads = 8;
  constexpr int kBlocksPerThread = 16;
  constexpr size_t kBlock = kPosixMaxIoBytes + 999;  // each write is split on posix
  const std::vector<uint8_t> data = Pattern(kThreads * kBlocksPerThread * kBlock, 42);
  const std::string path = Path("concurrent");
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Interleaved blocks, written back to front.
      for (int i = kBlocksPerThread - 1; i >= 0; --i) {
        const size_t block = static_cast<size_t>(i) * kThreads + t;
        Status s = w->WriteAt(block * kBlock, data.data() + block * kBlock, kBlock);
        if (!s.ok()) {
          results[t] = s;
          return;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const Status& s : results) STORAGE_EXPECT_OK(s);
  STORAGE_ASSERT_OK(w->Close());
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  ASSERT_EQ(r->size(), data.size());
  std::vector<uint8_t> back(data.size());
  STORAGE_ASSERT_OK(r->ReadAt(0, back.data(), back.size()));
  EXPECT_TRUE(back == data) << "concurrent writes lost or misplaced bytes";
}

TEST_P(RenameStorageTest, ConcurrentFileCreationInOneDirectory) {
  constexpr int kThreads = 4;
  constexpr int kFilesPerThread = 25;
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kFilesPerThread; ++i) {
        const std::string name = "f" + std::to_string(t) + "_" + std::to_string(i);
        Status s = WriteFile(storage(), Path(name), name);
        if (s.ok()) s = storage().Rename(Path(name), Path(name + ".done"));
        if (!s.ok()) {
          results[t] = s;
          return;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const Status& s : results) STORAGE_EXPECT_OK(s);
  STORAGE_ASSIGN_OR_FAIL(auto names, storage().ListDir(env_->root()));
  EXPECT_EQ(names.size(), static_cast<size_t>(kThreads * kFilesPerThread));
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), Path("f3_24.done")));
  EXPECT_EQ(got, "f3_24");
}

// StartWriteback is a hint: it changes no byte, and Sync still makes them durable.
TEST_P(StorageTest, StartWritebackKeepsTheBytes) {
  const std::vector<uint8_t> data = Pattern(3 << 20, 5);
  const std::string path = Path("streamed");
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  STORAGE_ASSERT_OK(w->WriteAt(0, data.data(), data.size() / 2));
  STORAGE_ASSERT_OK(w->StartWriteback(0, data.size() / 2));
  STORAGE_ASSERT_OK(w->WriteAt(data.size() / 2, data.data() + data.size() / 2, data.size() / 2));
  STORAGE_ASSERT_OK(w->StartWriteback(data.size() / 2, data.size() / 2));
  STORAGE_ASSERT_OK(w->StartWriteback(data.size(), 4096));  // past the end: nothing to do
  STORAGE_ASSERT_OK(w->Sync());
  STORAGE_ASSERT_OK(w->Close());
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_TRUE(got.size() == data.size() && std::memcmp(got.data(), data.data(), got.size()) == 0);
}

// CopyFrom puts exactly the source's bytes at the destination offset, in calls that cross
// max_io_bytes at odd offsets, and reports a source range past the end like ReadAt.
TEST_P(StorageTest, CopyFromCopiesTheRangeAndRefusesPastTheEnd) {
  const std::vector<uint8_t> data = Pattern(25 * kPosixMaxIoBytes + 123, 17);
  const std::string from = Path("from"), to = Path("to");
  {
    STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(from));
    STORAGE_ASSERT_OK(w->WriteAt(0, data.data(), data.size()));
    STORAGE_ASSERT_OK(w->Close());
  }
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(from));
  STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(to));
  STORAGE_ASSERT_OK(w->WriteAt(0, "head", 4));
  const uint64_t src_offset = 1001, n = 20 * kPosixMaxIoBytes + 7;
  STORAGE_ASSERT_OK(w->CopyFrom(*r, src_offset, 4, n));
  STORAGE_ASSERT_OK(w->CopyFrom(*r, 0, 4 + n, 3));  // a few bytes after, from the start
  STORAGE_ASSERT_OK(w->CopyFrom(*r, data.size(), 4 + n + 3, 0));  // nothing, at the end
  const Status past = w->CopyFrom(*r, data.size() - 5, 0, 10);
  EXPECT_EQ(past.code(), StatusCode::kDataLoss) << past.ToString();
  EXPECT_THAT(past.message(), HasSubstr(from));
  EXPECT_THAT(past.message(), HasSubstr("size " + std::to_string(data.size())));
  STORAGE_ASSERT_OK(w->Sync());
  STORAGE_ASSERT_OK(w->Close());
  EXPECT_FALSE(w->CopyFrom(*r, 0, 0, 1).ok());  // closed
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), to));
  std::string want = "head";
  want.append(data.begin() + src_offset, data.begin() + src_offset + n);
  want.append(data.begin(), data.begin() + 3);
  EXPECT_TRUE(got == want) << "copied bytes differ (" << got.size() << " bytes, want "
                           << want.size() << ")";
}

// Map is optional: a storage either declines with kUnimplemented or shows exactly the bytes
// ReadAt returns, at any offset, and rejects ranges past the end like ReadAt.
TEST_P(StorageTest, MapShowsTheBytesOfReadAtOrIsUnimplemented) {
  const std::vector<uint8_t> data = Pattern(3 * 4096 + 777, 11);
  const std::string path = Path("mapped");
  {
    STORAGE_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
    STORAGE_ASSERT_OK(w->WriteAt(0, data.data(), data.size()));
    STORAGE_ASSERT_OK(w->Close());
  }
  STORAGE_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  Result<FileMapping> probe = r->Map(0, data.size());
  if (!probe.ok()) {
    EXPECT_EQ(probe.status().code(), StatusCode::kUnimplemented) << probe.status().ToString();
    return;
  }
  const std::pair<uint64_t, size_t> ranges[] = {
      {0, data.size()}, {1, 10}, {4095, 2}, {4096, 4096}, {5000, 8000}, {data.size() - 1, 1}};
  for (const auto& [offset, n] : ranges) {
    STORAGE_ASSIGN_OR_FAIL(FileMapping m, r->Map(offset, n));
    ASSERT_EQ(m.bytes().size(), n) << "offset " << offset;
    EXPECT_EQ(std::memcmp(m.bytes().data(), data.data() + offset, n), 0) << "offset " << offset;
  }
  STORAGE_ASSIGN_OR_FAIL(FileMapping empty, r->Map(data.size(), 0));
  EXPECT_TRUE(empty.bytes().empty());
  const Result<FileMapping> past = r->Map(data.size() - 5, 10);
  EXPECT_EQ(past.status().code(), StatusCode::kDataLoss) << past.status().ToString();
  EXPECT_THAT(past.status().message(), HasSubstr(path));
  EXPECT_THAT(past.status().message(), HasSubstr("size " + std::to_string(data.size())));
  EXPECT_EQ(r->Map(~uint64_t{0} - 2, 8).status().code(), StatusCode::kDataLoss);
  // A mapping stays readable after its file object is gone and the file is removed.
  STORAGE_ASSIGN_OR_FAIL(FileMapping kept, r->Map(100, 200));
  r.reset();
  STORAGE_ASSERT_OK(storage().Remove(path));
  EXPECT_EQ(std::memcmp(kept.bytes().data(), data.data() + 100, 200), 0);
}

// ---- Publish: the one commit operation (stores with conditional_create) ---------------------

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// The names in the test directory that are Publish's temporaries.
std::vector<std::string> Temporaries(Storage& storage, const std::string& dir) {
  std::vector<std::string> out;
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (!names.ok()) return out;
  for (const std::string& n : *names) {
    if (ParsePublishTemporaryName(n, nullptr)) out.push_back(n);
  }
  return out;
}

// A store claims exactly the capabilities the suite instantiates it with (so no case that its
// capabilities select is left out, and none it cannot pass is run).
TEST_P(StorageTest, CapabilitiesAreTheOnesDeclared) {
  const StorageCapabilities c = storage().capabilities();
  const StorageCapabilities& want = GetParam().capabilities;
  EXPECT_EQ(c.rename, want.rename);
  EXPECT_EQ(c.positional_writes, want.positional_writes);
  EXPECT_EQ(c.directory_sync, want.directory_sync);
  EXPECT_EQ(c.conditional_create, want.conditional_create);
}

TEST_P(PublishStorageTest, CreateOnlyCreatesOnceAndRefusesAnExistingName) {
  const std::string path = Path("index");
  for (bool sync : {true, false}) {
    SCOPED_TRACE(sync ? "sync" : "no sync");
    STORAGE_ASSERT_OK(storage().Publish(path, AsBytes("first"), PublishMode::kCreateOnly, sync));
    STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
    EXPECT_EQ(got, "first");
    const Status again = storage().Publish(path, AsBytes("second"), PublishMode::kCreateOnly, sync);
    EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.ToString();
    EXPECT_THAT(again.message(), HasSubstr(path));
    STORAGE_ASSIGN_OR_FAIL(got, ReadFile(storage(), path));
    EXPECT_EQ(got, "first");
    EXPECT_THAT(Temporaries(storage(), env_->root()), IsEmpty());
    STORAGE_ASSERT_OK(storage().Remove(path));
  }
}

TEST_P(PublishStorageTest, ReplaceReplacesWholeAndCreatesWhenMissing) {
  const std::string path = Path("pointer");
  STORAGE_ASSERT_OK(storage().Publish(path, AsBytes("one"), PublishMode::kReplace, true));
  STORAGE_ASSERT_OK(
      storage().Publish(path, AsBytes("a longer second"), PublishMode::kReplace, false));
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "a longer second");
  STORAGE_ASSERT_OK(storage().Publish(path, AsBytes(""), PublishMode::kReplace, true));
  STORAGE_ASSIGN_OR_FAIL(got, ReadFile(storage(), path));
  EXPECT_EQ(got, "");
  STORAGE_ASSIGN_OR_FAIL(auto names, storage().ListDir(env_->root()));
  EXPECT_THAT(names, ElementsAre("pointer"));
}

// What a killed attempt left (its temporary, synced or not) never blocks a later Publish.
TEST_P(RenameStorageTest, PublishIsNotBlockedByTheTemporaryOfAKilledAttempt) {
  const std::string path = Path("marker");
  const std::string leftover = PublishTemporaryName(path);
  STORAGE_ASSERT_OK(WriteFile(storage(), leftover, "half"));
  std::string target;
  ASSERT_TRUE(
      ParsePublishTemporaryName(std::filesystem::path(leftover).filename().string(), &target));
  EXPECT_EQ(target, "marker");
  STORAGE_ASSERT_OK(storage().Publish(path, AsBytes("whole"), PublishMode::kCreateOnly, true));
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "whole");
  EXPECT_EQ(Temporaries(storage(), env_->root()).size(), 1u) << "the leftover, untouched";
}

// Of several threads creating one name at once, exactly one wins and its bytes are the file.
TEST_P(PublishStorageTest, CreateOnlyRacingCreatorsExactlyOneWins) {
  constexpr int kThreads = 6;
  for (int round = 0; round < 10; ++round) {
    const std::string path = Path("seq." + std::to_string(round));
    std::vector<Status> results(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        const std::string mine(1000 + t, static_cast<char>('a' + t));
        results[t] = storage().Publish(path, AsBytes(mine), PublishMode::kCreateOnly, t % 2 == 0);
      });
    }
    for (auto& thread : threads) thread.join();
    int winner = -1;
    for (int t = 0; t < kThreads; ++t) {
      if (results[t].ok()) {
        EXPECT_EQ(winner, -1) << "two creators won";
        winner = t;
      } else {
        EXPECT_EQ(results[t].code(), StatusCode::kAlreadyExists) << results[t].ToString();
      }
    }
    ASSERT_GE(winner, 0);
    STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
    EXPECT_EQ(got, std::string(1000 + winner, static_cast<char>('a' + winner)));
  }
  EXPECT_THAT(Temporaries(storage(), env_->root()), IsEmpty());
}

TEST_P(RenameStorageTest, RenameNoReplaceMovesOnlyOntoAFreeName) {
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("a"), "A"));
  STORAGE_ASSERT_OK(WriteFile(storage(), Path("b"), "B"));
  const Status taken = storage().RenameNoReplace(Path("a"), Path("b"));
  EXPECT_EQ(taken.code(), StatusCode::kAlreadyExists) << taken.ToString();
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), Path("b")));
  EXPECT_EQ(got, "B");
  STORAGE_ASSERT_OK(storage().RenameNoReplace(Path("a"), Path("c")));
  STORAGE_ASSIGN_OR_FAIL(got, ReadFile(storage(), Path("c")));
  EXPECT_EQ(got, "A");
  EXPECT_EQ(storage().RenameNoReplace(Path("a"), Path("d")).code(), StatusCode::kNotFound);
}

// ---- instantiation by capability -----------------------------------------------------------

std::vector<StorageKind> AllKinds() {
  const StorageCapabilities posix_like{.rename = true,
                                       .positional_writes = true,
                                       .directory_sync = true,
                                       .conditional_create = true};
  return {
    {"Posix", [] { return std::unique_ptr<StorageEnv>(new PosixEnv()); }, posix_like},
        {"Memory", [] { return std::unique_ptr<StorageEnv>(new MemoryEnv()); }, posix_like},
        {"FaultInjecting", [] { return std::unique_ptr<StorageEnv>(new FaultInjectingEnv()); },
         posix_like},
#if TESSERA_HAVE_S3
        {"S3", [] { return std::unique_ptr<StorageEnv>(new S3Env()); },
         StorageCapabilities{.conditional_create = true}},
#endif
  };
}

std::vector<StorageKind> KindsWith(bool StorageCapabilities::*capability) {
  std::vector<StorageKind> kinds;
  for (StorageKind& kind : AllKinds()) {
    if (capability == nullptr || kind.capabilities.*capability) kinds.push_back(std::move(kind));
  }
  return kinds;
}

std::string KindName(const ::testing::TestParamInfo<StorageKind>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(AllStorages, StorageTest, ::testing::ValuesIn(KindsWith(nullptr)),
                         KindName);
INSTANTIATE_TEST_SUITE_P(AllStorages, PositionalWritesStorageTest,
                         ::testing::ValuesIn(KindsWith(&StorageCapabilities::positional_writes)),
                         KindName);
INSTANTIATE_TEST_SUITE_P(AllStorages, RenameStorageTest,
                         ::testing::ValuesIn(KindsWith(&StorageCapabilities::rename)), KindName);
INSTANTIATE_TEST_SUITE_P(AllStorages, DirectoryStorageTest,
                         ::testing::ValuesIn(KindsWith(&StorageCapabilities::directory_sync)),
                         KindName);
INSTANTIATE_TEST_SUITE_P(AllStorages, PublishStorageTest,
                         ::testing::ValuesIn(KindsWith(&StorageCapabilities::conditional_create)),
                         KindName);

// ---- JoinPath and posix specifics ----------------------------------------------------------

TEST(JoinPathTest, JoinsWithOneSlash) {
  EXPECT_EQ(JoinPath("a", "b"), "a/b");
  EXPECT_EQ(JoinPath("a/", "b"), "a/b");
  EXPECT_EQ(JoinPath("a//", "/b"), "a/b");
  EXPECT_EQ(JoinPath("/", "b"), "/b");
  EXPECT_EQ(JoinPath("/x/y", "b/c"), "/x/y/b/c");
  EXPECT_EQ(JoinPath("", "b"), "b");
  EXPECT_EQ(JoinPath("a", ""), "a");
}

// The open file descriptor of `path` in this process, or -1.
int FindFd(const std::string& path) {
  const std::string want = std::filesystem::canonical(path).string();
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(entry.path(), ec);
    if (!ec && target.string() == want) return std::stoi(entry.path().filename().string());
  }
  return -1;
}

TEST(PosixStorageTest, FilesAreCloseOnExecAndMode0644) {
  PosixEnv env;
  const std::string path = JoinPath(env.root(), "f");
  STORAGE_ASSIGN_OR_FAIL(auto w, env.storage().NewWritableFile(path));
  int fd = FindFd(path);
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC) << "writable file not O_CLOEXEC";
  STORAGE_ASSERT_OK(w->Close());

  STORAGE_ASSIGN_OR_FAIL(auto r, env.storage().NewReadableFile(path));
  fd = FindFd(path);
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC) << "readable file not O_CLOEXEC";

  const mode_t mask = ::umask(0);
  ::umask(mask);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644 & ~mask);
}

TEST(PosixStorageTest, ErrorsNameTheOperationPathAndErrno) {
  PosixEnv env;
  const std::string file = JoinPath(env.root(), "file");
  STORAGE_ASSERT_OK(WriteFile(env.storage(), file, "x"));
  const std::string under_file = JoinPath(file, "child");
  auto w = env.storage().NewWritableFile(under_file);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kIOError);
  EXPECT_THAT(w.status().message(), StartsWith("open " + under_file));
  EXPECT_THAT(w.status().message(), HasSubstr(std::strerror(ENOTDIR)));

  const Status rename = env.storage().Rename(JoinPath(env.root(), "nope"), file);
  EXPECT_THAT(rename.message(), StartsWith("rename " + JoinPath(env.root(), "nope") + " to " +
                                           file + ": " + std::strerror(ENOENT)));
}

TEST(PosixStorageTest, WritesLandInTheRealFile) {
  PosixEnv env;
  const std::string path = JoinPath(env.root(), "real");
  STORAGE_ASSERT_OK(WriteFile(env.storage(), path, "bytes on disk"));
  std::ifstream in(path, std::ios::binary);
  std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, "bytes on disk");
}

TEST(PosixStorageTest, MapIsOnByDefaultAndCanBeTurnedOff) {
  PosixEnv env;
  const std::string path = JoinPath(env.root(), "f");
  STORAGE_ASSERT_OK(WriteFile(env.storage(), path, "mapped bytes"));
  {
    STORAGE_ASSIGN_OR_FAIL(auto r, NewPosixStorage()->NewReadableFile(path));
    STORAGE_ASSIGN_OR_FAIL(FileMapping m, r->Map(7, 5));
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.bytes().data()), 5), "bytes");
  }
  STORAGE_ASSIGN_OR_FAIL(auto r, NewPosixStorage({.map_reads = false})->NewReadableFile(path));
  const Result<FileMapping> m = r->Map(0, 5);
  EXPECT_EQ(m.status().code(), StatusCode::kUnimplemented) << m.status().ToString();
  EXPECT_THAT(m.status().message(), HasSubstr("map_reads"));
}

// Issue 11, item 5: a symbolic link planted under the name of a new file (pointing at a file
// outside, or dangling) is refused, never followed: the target is neither written nor created.
TEST(PosixStorageTest, ExclusiveCreateNeverFollowsASymbolicLink) {
  PosixEnv env;
  PosixEnv outside;
  const std::string target = JoinPath(outside.root(), "victim");
  STORAGE_ASSERT_OK(WriteFile(outside.storage(), target, "not yours"));
  const std::string missing_target = JoinPath(outside.root(), "created?");
  for (const std::string& to : {target, missing_target}) {
    const std::string link = JoinPath(env.root(), "link");
    ::unlink(link.c_str());
    ASSERT_EQ(::symlink(to.c_str(), link.c_str()), 0) << std::strerror(errno);
    auto w = env.storage().NewWritableFile(link);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), StatusCode::kAlreadyExists) << w.status().ToString();
    EXPECT_THAT(w.status().message(), HasSubstr("open " + link + " for writing as a new file"));
  }
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(outside.storage(), target));
  EXPECT_EQ(got, "not yours");
  STORAGE_ASSIGN_OR_FAIL(FileType type, outside.storage().Stat(missing_target));
  EXPECT_EQ(type, FileType::kNotFound);
}

TEST(PosixStorageTest, StartWritebackOfAClosedFileFails) {
  PosixEnv env;
  const std::string path = JoinPath(env.root(), "f");
  STORAGE_ASSIGN_OR_FAIL(auto w, env.storage().NewWritableFile(path));
  STORAGE_ASSERT_OK(w->WriteAt(0, "x", 1));
  STORAGE_ASSERT_OK(w->Close());
  const Status s = w->StartWriteback(0, 1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr(path));
}

TEST(FileMappingTest, ReleasesExactlyOnceAcrossMoves) {
  int releases = 0;
  const std::byte bytes[4] = {};
  {
    FileMapping a(std::span<const std::byte>(bytes, 4), [&] { ++releases; });
    FileMapping b(std::move(a));
    EXPECT_TRUE(a.bytes().empty());
    EXPECT_EQ(b.bytes().size(), 4u);
    FileMapping c;
    c = std::move(b);
    EXPECT_EQ(releases, 0);
    c = FileMapping(std::span<const std::byte>(bytes, 2), [&] { releases += 10; });
    EXPECT_EQ(releases, 1);  // the first mapping, assigned over
  }
  EXPECT_EQ(releases, 11);
}

// ---- MemoryStorage: paths and the crash model ----------------------------------------------

TEST(MemoryStorageTest, PathsAreNormalised) {
  MemoryStorage m;
  STORAGE_ASSERT_OK(m.CreateDirs("d/e/"));
  STORAGE_ASSERT_OK(WriteFile(m, "/d//e/x", "1"));
  for (const char* alias : {"d/e/x", "/d/e/x", "d/./e/x", "d/e/../e/x", "d/e/x/"}) {
    STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(m, alias));
    EXPECT_EQ(got, "1") << alias;
  }
  STORAGE_ASSIGN_OR_FAIL(auto names, m.ListDir("/"));
  EXPECT_THAT(names, ElementsAre("d"));
}

TEST(MemoryStorageTest, DirectoriesExistImplicitlyForSetFiles) {
  MemoryStorage m;
  m.SetFileContents("a/b/f", Bytes("x"));
  STORAGE_ASSIGN_OR_FAIL(FileType type, m.Stat("a/b"));
  EXPECT_EQ(type, FileType::kDirectory);
  STORAGE_ASSIGN_OR_FAIL(auto names, m.ListDir("a"));
  EXPECT_THAT(names, ElementsAre("b"));
}

TEST(MemoryStorageTest, GetAndSetFileContents) {
  MemoryStorage m;
  EXPECT_EQ(m.GetFileContents("nope").status().code(), StatusCode::kNotFound);
  m.SetFileContents("d/f", Bytes("abc"));
  STORAGE_ASSIGN_OR_FAIL(auto got, m.GetFileContents("d/f"));
  EXPECT_EQ(got, Bytes("abc"));
  // Set contents are durable: entry and bytes.
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(auto after, m.GetFileContents("d/f"));
  EXPECT_EQ(after, Bytes("abc"));
}

TEST(MemoryStorageTest, UnsyncedBytesAreLostInCrash) {
  MemoryStorage m;
  STORAGE_ASSERT_OK(m.CreateDirs("d"));
  STORAGE_ASSERT_OK(m.SyncDir("/"));
  STORAGE_ASSIGN_OR_FAIL(auto w, m.NewWritableFile("d/f"));
  STORAGE_ASSERT_OK(m.SyncDir("d"));
  STORAGE_ASSERT_OK(w->WriteAt(0, "abc", 3));
  STORAGE_ASSERT_OK(w->Sync());
  STORAGE_ASSERT_OK(w->WriteAt(3, "def", 3));
  STORAGE_ASSERT_OK(w->WriteAt(0, "X", 1));
  STORAGE_ASSIGN_OR_FAIL(auto before, m.GetFileContents("d/f"));
  EXPECT_EQ(before, Bytes("Xbcdef"));
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(auto after, m.GetFileContents("d/f"));
  EXPECT_EQ(after, Bytes("abc"));
}

TEST(MemoryStorageTest, UnsyncedNewEntryIsLostInCrash) {
  MemoryStorage m;
  STORAGE_ASSERT_OK(m.CreateDirs("d"));
  STORAGE_ASSERT_OK(m.SyncDir("/"));
  STORAGE_ASSERT_OK(WriteFile(m, "d/f", "synced bytes"));  // file synced, dir not
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(FileType type, m.Stat("d/f"));
  EXPECT_EQ(type, FileType::kNotFound);
  STORAGE_ASSIGN_OR_FAIL(auto names, m.ListDir("d"));
  EXPECT_THAT(names, IsEmpty());
}

TEST(MemoryStorageTest, UnsyncedDirectoryIsLostInCrash) {
  MemoryStorage m;
  STORAGE_ASSERT_OK(m.CreateDirs("a/b"));
  STORAGE_ASSERT_OK(m.SyncDir("a"));  // b is durable in a, but a is not durable in /
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(FileType type, m.Stat("a"));
  EXPECT_EQ(type, FileType::kNotFound);
}

TEST(MemoryStorageTest, RenameIsNotDurableUntilSyncDir) {
  MemoryStorage m;
  m.SetFileContents("ckpt/manifest", Bytes("old"));
  STORAGE_ASSERT_OK(WriteFile(m, "ckpt/manifest.tmp", "new"));
  STORAGE_ASSERT_OK(m.SyncDir("ckpt"));
  STORAGE_ASSERT_OK(m.Rename("ckpt/manifest.tmp", "ckpt/manifest"));
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(auto old_contents, m.GetFileContents("ckpt/manifest"));
  EXPECT_EQ(old_contents, Bytes("old"));
  STORAGE_ASSIGN_OR_FAIL(auto tmp_contents, m.GetFileContents("ckpt/manifest.tmp"));
  EXPECT_EQ(tmp_contents, Bytes("new"));

  STORAGE_ASSERT_OK(m.Rename("ckpt/manifest.tmp", "ckpt/manifest"));
  STORAGE_ASSERT_OK(m.SyncDir("ckpt"));
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(auto new_contents, m.GetFileContents("ckpt/manifest"));
  EXPECT_EQ(new_contents, Bytes("new"));
  STORAGE_ASSIGN_OR_FAIL(auto names, m.ListDir("ckpt"));
  EXPECT_THAT(names, ElementsAre("manifest"));
}

TEST(MemoryStorageTest, RemoveIsNotDurableUntilSyncDir) {
  MemoryStorage m;
  m.SetFileContents("d/f", Bytes("keep"));
  STORAGE_ASSERT_OK(m.Remove("d/f"));
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(auto back, m.GetFileContents("d/f"));
  EXPECT_EQ(back, Bytes("keep"));
  STORAGE_ASSERT_OK(m.Remove("d/f"));
  STORAGE_ASSERT_OK(m.SyncDir("d"));
  m.SimulateCrash();
  EXPECT_EQ(m.GetFileContents("d/f").status().code(), StatusCode::kNotFound);
}

TEST(MemoryStorageTest, TruncationIsNotDurableUntilSync) {
  MemoryStorage m;
  m.SetFileContents("f", Bytes("durable"));
  STORAGE_ASSIGN_OR_FAIL(auto w, m.NewWritableFile("f", CreateMode::kTruncate));
  STORAGE_ASSERT_OK(w->WriteAt(0, "v2", 2));
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(auto got, m.GetFileContents("f"));
  EXPECT_EQ(got, Bytes("durable"));
}

TEST(MemoryStorageTest, SyncedDataInSyncedDirectoriesSurvivesCrash) {
  MemoryStorage m;
  STORAGE_ASSERT_OK(m.CreateDirs("a/b"));
  STORAGE_ASSERT_OK(WriteFile(m, "a/b/f", "payload"));  // writes and syncs the bytes
  STORAGE_ASSERT_OK(m.SyncDir("a/b"));
  STORAGE_ASSERT_OK(m.SyncDir("a"));
  STORAGE_ASSERT_OK(m.SyncDir(""));
  m.SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(m, "a/b/f"));
  EXPECT_EQ(got, "payload");
}

TEST(MemoryStorageTest, FilesOpenedBeforeCrashStopWorking) {
  MemoryStorage m;
  m.SetFileContents("f", Bytes("abc"));
  STORAGE_ASSIGN_OR_FAIL(auto w, m.NewWritableFile("g"));
  STORAGE_ASSIGN_OR_FAIL(auto r, m.NewReadableFile("f"));
  m.SimulateCrash();
  EXPECT_FALSE(w->WriteAt(0, "x", 1).ok());
  EXPECT_FALSE(w->Sync().ok());
  char c;
  EXPECT_FALSE(r->ReadAt(0, &c, 1).ok());
  STORAGE_EXPECT_OK(w->Close());
}

TEST(MemoryStorageTest, RenameOfDirectoryIntoItselfFails) {
  MemoryStorage m;
  STORAGE_ASSERT_OK(m.CreateDirs("a/b"));
  EXPECT_EQ(m.Rename("a", "a/b/c").code(), StatusCode::kIOError);
  STORAGE_ASSIGN_OR_FAIL(FileType type, m.Stat("a/b"));
  EXPECT_EQ(type, FileType::kDirectory);
}

// ---- FaultInjectingStorage -----------------------------------------------------------------

struct Step {
  std::string op;
  std::string path;
  Status status;
};

// A fixed sequence of one-operation steps; returns what each step that ran returned.
std::vector<Step> RunScenario(Storage& s) {
  std::vector<Step> steps;
  auto record = [&](const char* op, const std::string& path, Status st) {
    steps.push_back(Step{op, path, std::move(st)});
  };
  record("CreateDirs", "d", s.CreateDirs("d"));
  auto w = s.NewWritableFile("d/f");
  record("NewWritableFile", "d/f", w.status());
  if (w.ok()) {
    record("WriteAt", "d/f", (*w)->WriteAt(0, "data", 4));
    record("Sync", "d/f", (*w)->Sync());
    record("Close", "d/f", (*w)->Close());
  }
  record("SyncDir", "d", s.SyncDir("d"));
  record("Stat", "d/f", s.Stat("d/f").status());
  auto r = s.NewReadableFile("d/f");
  record("NewReadableFile", "d/f", r.status());
  if (r.ok()) {
    char c;
    record("ReadAt", "d/f", (*r)->ReadAt(0, &c, 0));
  }
  record("ListDir", "d", s.ListDir("d").status());
  record("Rename", "d/f -> d/g", s.Rename("d/f", "d/g"));
  record("Remove", "d/g", s.Remove("d/g"));
  return steps;
}

FaultPlan Plan(int64_t fail_at, bool crash = false, std::string path_filter = "") {
  FaultPlan plan;
  plan.fail_at = fail_at;
  plan.crash = crash;
  plan.path_filter = std::move(path_filter);
  return plan;
}

bool IsInjected(const Status& s) {
  return s.code() == StatusCode::kIOError && s.message().rfind("injected fault", 0) == 0;
}

TEST(FaultInjectingStorageTest, NoPlanCountsEveryOperation) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>());
  const std::vector<Step> steps = RunScenario(f);
  ASSERT_EQ(steps.size(), 12u);
  for (const Step& step : steps) STORAGE_EXPECT_OK(step.status);
  EXPECT_EQ(f.operation_count(), 12);
  EXPECT_FALSE(f.fault_fired());
}

TEST(FaultInjectingStorageTest, FailAtFailsExactlyThatOperation) {
  for (int64_t n = 0; n < 12; ++n) {
    SCOPED_TRACE("fail_at " + std::to_string(n));
    FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(n));
    const std::vector<Step> steps = RunScenario(f);
    ASSERT_GT(steps.size(), static_cast<size_t>(n));
    int injected = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (!IsInjected(steps[i].status)) continue;
      ++injected;
      EXPECT_EQ(i, static_cast<size_t>(n)) << steps[i].status.ToString();
    }
    EXPECT_EQ(injected, 1);
    const Step& failed = steps[n];
    EXPECT_EQ(failed.status.code(), StatusCode::kIOError);
    EXPECT_EQ(failed.status.message(), "injected fault at operation " + std::to_string(n) + " (" +
                                           failed.op + " " + failed.path + ")");
    EXPECT_TRUE(f.fault_fired());
    EXPECT_EQ(f.operation_count(), static_cast<int64_t>(steps.size()));
  }
}

TEST(FaultInjectingStorageTest, FailAtBeyondTheLastOperationNeverFires) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(12));
  for (const Step& step : RunScenario(f)) STORAGE_EXPECT_OK(step.status);
  EXPECT_FALSE(f.fault_fired());
}

TEST(FaultInjectingStorageTest, InjectedFaultDoesNotReachTheBase) {
  auto memory = std::make_shared<MemoryStorage>();
  FaultInjectingStorage f(memory, Plan(2));  // the WriteAt
  STORAGE_ASSERT_OK(f.CreateDirs("d"));
  STORAGE_ASSIGN_OR_FAIL(auto w, f.NewWritableFile("d/f"));
  EXPECT_TRUE(IsInjected(w->WriteAt(0, "data", 4)));
  STORAGE_ASSIGN_OR_FAIL(auto contents, memory->GetFileContents("d/f"));
  EXPECT_THAT(contents, IsEmpty());
  // The next operation works again.
  STORAGE_ASSERT_OK(w->WriteAt(0, "data", 4));
  STORAGE_ASSIGN_OR_FAIL(contents, memory->GetFileContents("d/f"));
  EXPECT_EQ(contents, Bytes("data"));
}

// CopyFrom is one operation, whatever its length; an injected fault copies nothing. Over a
// POSIX base the copy reaches the base with the unwrapped source (copy_file_range).
TEST(FaultInjectingStorageTest, CopyFromIsOneOperationThatCanFail) {
  auto memory = std::make_shared<MemoryStorage>();
  const std::vector<uint8_t> data = Pattern(3 << 20, 3);
  memory->SetFileContents("d/src", data);
  FaultInjectingStorage f(memory, Plan(3));                    // the second CopyFrom
  STORAGE_ASSIGN_OR_FAIL(auto r, f.NewReadableFile("d/src"));  // 0
  STORAGE_ASSIGN_OR_FAIL(auto w, f.NewWritableFile("d/dst"));  // 1
  STORAGE_ASSERT_OK(w->CopyFrom(*r, 0, 0, data.size()));       // 2
  const Status failed = w->CopyFrom(*r, 0, data.size(), 100);  // 3
  EXPECT_TRUE(IsInjected(failed)) << failed.ToString();
  EXPECT_EQ(failed.message(), "injected fault at operation 3 (CopyFrom d/dst)");
  EXPECT_EQ(f.operation_count(), 4);
  STORAGE_ASSIGN_OR_FAIL(auto contents, memory->GetFileContents("d/dst"));
  EXPECT_TRUE(contents == data);

  char tmpl[] = "/tmp/tessera_copy_test_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  FaultInjectingStorage posix(NewPosixStorage());
  STORAGE_ASSERT_OK(WriteFile(posix, dir + "/src", std::string(data.begin(), data.end())));
  STORAGE_ASSIGN_OR_FAIL(auto pr, posix.NewReadableFile(dir + "/src"));
  STORAGE_ASSIGN_OR_FAIL(auto pw, posix.NewWritableFile(dir + "/dst"));
  STORAGE_ASSERT_OK(pw->CopyFrom(*pr, 10, 0, data.size() - 10));
  STORAGE_ASSERT_OK(pw->Close());
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(posix, dir + "/dst"));
  EXPECT_TRUE(got == std::string(data.begin() + 10, data.end()));
  std::filesystem::remove_all(dir);
}

// A source of another storage is copied through the default's buffer.
TEST(PosixStorageTest, CopyFromAnotherStorageGoesThroughABuffer) {
  MemoryStorage memory;
  const std::vector<uint8_t> data = Pattern((1 << 20) * 2 + 5, 4);
  memory.SetFileContents("/m/src", data);
  char tmpl[] = "/tmp/tessera_copy_test_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::shared_ptr<Storage> posix = NewPosixStorage();
  STORAGE_ASSIGN_OR_FAIL(auto r, memory.NewReadableFile("/m/src"));
  STORAGE_ASSIGN_OR_FAIL(auto w, posix->NewWritableFile(dir + "/dst"));
  STORAGE_ASSERT_OK(w->CopyFrom(*r, 0, 0, data.size()));
  STORAGE_ASSERT_OK(w->Close());
  STORAGE_ASSIGN_OR_FAIL(std::string got, ReadFile(*posix, dir + "/dst"));
  EXPECT_TRUE(got == std::string(data.begin(), data.end()));
  std::filesystem::remove_all(dir);
}

TEST(FaultInjectingStorageTest, CrashFailsEveryLaterOperation) {
  auto memory = std::make_shared<MemoryStorage>();
  FaultInjectingStorage f(memory, Plan(4, true));  // the Close
  const std::vector<Step> steps = RunScenario(f);
  ASSERT_EQ(steps.size(), 11u);  // no ReadAt: NewReadableFile failed
  for (size_t i = 0; i < steps.size(); ++i) {
    if (i < 4) {
      STORAGE_EXPECT_OK(steps[i].status);
    } else {
      EXPECT_TRUE(IsInjected(steps[i].status)) << i << ": " << steps[i].status.ToString();
      EXPECT_THAT(steps[i].status.message(), HasSubstr(steps[i].op + " " + steps[i].path));
    }
  }
  EXPECT_EQ(steps[4].status.message(), "injected fault at operation 4 (Close d/f)");
  EXPECT_THAT(steps[5].status.message(), HasSubstr("operation 4"));
  EXPECT_EQ(f.operation_count(), 11);
  // Nothing after the crash reached the base: the rename and remove did not happen.
  STORAGE_ASSIGN_OR_FAIL(auto contents, memory->GetFileContents("d/f"));
  EXPECT_EQ(contents, Bytes("data"));
  // The directory entry was never synced, so a real crash loses the file.
  memory->SimulateCrash();
  STORAGE_ASSIGN_OR_FAIL(FileType type, memory->Stat("d/f"));
  EXPECT_EQ(type, FileType::kNotFound);
}

TEST(FaultInjectingStorageTest, SetPlanResetsTheCounter) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(0, true));
  EXPECT_TRUE(IsInjected(f.CreateDirs("d")));
  EXPECT_TRUE(IsInjected(f.CreateDirs("d")));
  EXPECT_EQ(f.operation_count(), 2);
  f.SetPlan(FaultPlan{});
  EXPECT_EQ(f.operation_count(), 0);
  EXPECT_FALSE(f.fault_fired());
  STORAGE_EXPECT_OK(f.CreateDirs("d"));
  STORAGE_EXPECT_OK(f.Stat("d"));
  EXPECT_EQ(f.operation_count(), 2);
  f.SetPlan(Plan(1));
  STORAGE_EXPECT_OK(f.Stat("d"));
  EXPECT_TRUE(IsInjected(f.Stat("d").status()));
  STORAGE_EXPECT_OK(f.Stat("d"));
}

TEST(FaultInjectingStorageTest, CheckCountsLikeAnyOperation) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(1));
  STORAGE_EXPECT_OK(f.Check("Custom", "p"));
  const Status s = f.Check("Custom", "p");
  EXPECT_EQ(s.message(), "injected fault at operation 1 (Custom p)");
  EXPECT_EQ(f.operation_count(), 2);
}

TEST(FaultInjectingStorageTest, PathFilterCountsOnlyMatchingOperations) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(1, false, "manifest"));
  STORAGE_ASSERT_OK(f.CreateDirs("ckpt"));
  STORAGE_ASSERT_OK(WriteFile(f, "ckpt/data_0", "d"));  // 4 operations, none counted
  EXPECT_EQ(f.operation_count(), 0);
  STORAGE_ASSIGN_OR_FAIL(auto w, f.NewWritableFile("ckpt/manifest.tmp"));  // operation 0
  STORAGE_ASSERT_OK(WriteFile(f, "ckpt/data_1", "d"));
  const Status s = w->WriteAt(0, "m", 1);  // operation 1
  EXPECT_EQ(s.message(), "injected fault at operation 1 (WriteAt ckpt/manifest.tmp)");
  STORAGE_EXPECT_OK(w->WriteAt(0, "m", 1));
  // Rename counts when either end matches.
  STORAGE_EXPECT_OK(f.Rename("ckpt/manifest.tmp", "ckpt/manifest"));
  EXPECT_EQ(f.operation_count(), 4);
}

TEST(FaultInjectingStorageTest, CrashWithPathFilterStopsEverything) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(0, true, "manifest"));
  STORAGE_ASSERT_OK(f.CreateDirs("ckpt"));
  EXPECT_TRUE(IsInjected(f.NewWritableFile("ckpt/manifest").status()));
  // After the crash even unmatched operations fail: the process is dead.
  EXPECT_TRUE(IsInjected(f.CreateDirs("ckpt")));
  EXPECT_EQ(f.operation_count(), 1);
}

TEST(FaultInjectingStorageTest, FilesOutliveTheStorage) {
  auto memory = std::make_shared<MemoryStorage>();
  std::unique_ptr<WritableFile> w;
  {
    FaultInjectingStorage f(memory, Plan(2));
    STORAGE_ASSIGN_OR_FAIL(w, f.NewWritableFile("f"));
    STORAGE_ASSERT_OK(w->WriteAt(0, "a", 1));
  }
  EXPECT_TRUE(IsInjected(w->Sync()));
  STORAGE_EXPECT_OK(w->Close());
}

TEST(FaultInjectingStorageTest, ConcurrentOperationsAreNumberedOnce) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(500));
  STORAGE_ASSERT_OK(f.CreateDirs("d"));
  constexpr int kThreads = 4;
  constexpr int kOps = 300;
  std::vector<int> injected(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOps; ++i) {
        if (IsInjected(f.Stat("d").status())) ++injected[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  int total = 0;
  for (int n : injected) total += n;
  EXPECT_EQ(total, 1);
  EXPECT_EQ(f.operation_count(), 1 + kThreads * kOps);
}

// ---- Publish under faults and crashes -----------------------------------------------------

std::span<const std::byte> Span(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// A synced Publish is the temporary file's creation, write, sync and close, the rename and the
// directory's sync; unsynced, the creation, write, close and rename.
TEST(FaultInjectingStorageTest, PublishIsMadeOfCountedSteps) {
  auto memory = std::make_shared<MemoryStorage>();
  ASSERT_TRUE(memory->CreateDirs("/d").ok());
  FaultInjectingStorage f(memory);
  STORAGE_ASSERT_OK(f.Publish("/d/x", Span("bytes"), PublishMode::kCreateOnly, true));
  EXPECT_EQ(f.operation_count(), 6);
  f.SetPlan(FaultPlan{});
  STORAGE_ASSERT_OK(f.Publish("/d/x", Span("more"), PublishMode::kReplace, false));
  EXPECT_EQ(f.operation_count(), 4);
}

// Over a store without rename, Publish is that store's, counted as one operation.
TEST(FaultInjectingStorageTest, PublishOverAStoreWithoutRenameIsOneOperation) {
  class NoRename : public StorageWrapper {
   public:
    using StorageWrapper::StorageWrapper;
    StorageCapabilities capabilities() const override {
      return StorageCapabilities{.conditional_create = true};
    }
    Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                   bool sync) override {
      ++publishes;
      return target().Publish(path, bytes, mode, sync);
    }
    int publishes = 0;
  };
  auto memory = std::make_shared<MemoryStorage>();
  ASSERT_TRUE(memory->CreateDirs("/d").ok());
  auto store = std::make_shared<NoRename>(memory);
  FaultInjectingStorage f(store, Plan(0));
  const Status failed = f.Publish("/d/x", Span("bytes"), PublishMode::kCreateOnly, true);
  EXPECT_TRUE(IsInjected(failed)) << failed.ToString();
  EXPECT_THAT(failed.message(), HasSubstr("Publish /d/x"));
  EXPECT_EQ(store->publishes, 0);
  f.SetPlan(FaultPlan{});
  STORAGE_ASSERT_OK(f.Publish("/d/x", Span("bytes"), PublishMode::kCreateOnly, true));
  EXPECT_EQ(f.operation_count(), 1);
  EXPECT_EQ(store->publishes, 1);
  EXPECT_FALSE(f.capabilities().rename);
}

// A machine crash at every step of a synced Publish leaves the old content (or no file) or the
// whole new one; a Publish that returned OK survives the crash.
TEST(MemoryStorageTest, CrashAtEveryStepOfAPublishLeavesTheOldContentOrTheNew) {
  for (PublishMode mode : {PublishMode::kCreateOnly, PublishMode::kReplace}) {
    const bool replace = mode == PublishMode::kReplace;
    SCOPED_TRACE(replace ? "replace" : "create-only");
    int old_seen = 0, new_seen = 0;
    for (int64_t n = 0;; ++n) {
      auto memory = std::make_shared<MemoryStorage>();
      if (replace) memory->SetFileContents("/d/x", Bytes("old"));
      ASSERT_TRUE(memory->CreateDirs("/d").ok());
      ASSERT_TRUE(memory->SyncDir("/").ok());
      FaultInjectingStorage f(memory, Plan(n, /*crash=*/true));
      const Status published = f.Publish("/d/x", Span("the new bytes"), mode, true);
      const bool past_the_end = !f.fault_fired();
      memory->SimulateCrash();
      Result<std::vector<uint8_t>> got = memory->GetFileContents("/d/x");
      const bool is_new = got.ok() && *got == Bytes("the new bytes");
      const bool is_old = replace ? got.ok() && *got == Bytes("old") : !got.ok();
      EXPECT_TRUE(is_new || is_old) << "step " << n;
      if (published.ok()) {
        EXPECT_TRUE(is_new) << "step " << n;
      }
      (is_new ? new_seen : old_seen)++;
      // No temporary survives a crash: it was never made durable.
      Result<std::vector<std::string>> names = memory->ListDir("/d");
      ASSERT_TRUE(names.ok());
      EXPECT_EQ(names->size(), is_old && !replace ? 0u : 1u) << "step " << n;
      if (past_the_end) break;
    }
    EXPECT_GT(old_seen, 3);
    EXPECT_GT(new_seen, 0);
  }
}

// Unsynced, a crash may lose the new content, never tear it.
TEST(MemoryStorageTest, UnsyncedPublishMayVanishInACrashButIsNeverTorn) {
  MemoryStorage memory;
  memory.SetFileContents("/d/x", Bytes("old"));
  ASSERT_TRUE(memory.Publish("/d/x", Span("new"), PublishMode::kReplace, false).ok());
  ASSERT_TRUE(memory.Publish("/d/y", Span("y"), PublishMode::kCreateOnly, false).ok());
  memory.SimulateCrash();
  Result<std::vector<uint8_t>> x = memory.GetFileContents("/d/x");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(*x, Bytes("old"));
  EXPECT_FALSE(memory.GetFileContents("/d/y").ok());
}

// A process killed in the middle of a Publish keeps its temporary (the file system keeps what
// a process wrote): it is a name of its own, never the target, and never in a later Publish's
// way.
TEST(PosixStorageTest, PublishKilledMidWayLeavesOnlyATemporaryBeside) {
  char tmpl[] = "/tmp/tessera_publish_kill_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const pid_t child = fork();
  if (child == 0) {
    class KillBeforeRename : public StorageWrapper {
     public:
      using StorageWrapper::StorageWrapper;
      Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                     bool sync) override {
        return PublishThroughRename(path, bytes, mode, sync);
      }
      Status RenameNoReplace(const std::string&, const std::string&) override {
        ::raise(SIGKILL);
        return Status::Ok();
      }
    };
    KillBeforeRename killing(NewPosixStorage());
    (void)killing.Publish(dir + "/x", Span("killed"), PublishMode::kCreateOnly, true);
    ::_exit(3);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);
  std::shared_ptr<Storage> posix = NewPosixStorage();
  std::vector<std::string> left = Temporaries(*posix, dir);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(posix->Stat(dir + "/x").value(), FileType::kNotFound);
  STORAGE_ASSERT_OK(posix->Publish(dir + "/x", Span("retried"), PublishMode::kCreateOnly, true));
  EXPECT_EQ(ReadFile(*posix, dir + "/x").value(), "retried");
  std::filesystem::remove_all(dir);
}

TEST(PosixStorageTest, RenameNoReplaceRefusesADanglingSymbolicLink) {
  char tmpl[] = "/tmp/tessera_noreplace_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::shared_ptr<Storage> posix = NewPosixStorage();
  ASSERT_EQ(::symlink((dir + "/nowhere").c_str(), (dir + "/link").c_str()), 0);
  STORAGE_ASSERT_OK(WriteFile(*posix, dir + "/a", "A"));
  EXPECT_EQ(posix->RenameNoReplace(dir + "/a", dir + "/link").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(posix->Publish(dir + "/link", Span("x"), PublishMode::kCreateOnly, true).code(),
            StatusCode::kAlreadyExists);
  EXPECT_FALSE(std::filesystem::exists(dir + "/nowhere"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera
