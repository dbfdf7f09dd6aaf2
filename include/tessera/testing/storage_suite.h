// The Storage conformance suite: every case that any Storage must pass, and those that need a
// capability (positional writes, rename, directories, Publish), for a store to instantiate with
// one macro. tessera runs it on every store it has (POSIX, memory, fault-injecting, S3); a
// user's own Storage runs it the same way:
//
//   #include "tessera/testing/storage_suite.h"
//
//   TESSERA_INSTANTIATE_STORAGE_SUITE(
//       MyStore,
//       [] () -> tessera::Result<std::unique_ptr<tessera::testing::StorageSuiteEnv>> {
//         auto store = std::make_shared<MyStore>(...);
//         return std::make_unique<tessera::testing::SimpleStorageSuiteEnv>(store, "/some/root");
//       },
//       (tessera::StorageCapabilities{.conditional_create = true}));
//
// and links GoogleTest's gtest_main (or its own main). Each case gets a fresh environment from
// the factory. The capabilities given are those the store claims (every case checks that
// capabilities() returns exactly them): a case that needs one the store lacks is not
// registered at all, so no case passes by skipping. The tests are named
// <Name>/<Group>.<Case>, the group saying what the case needs: StorageTest (nothing),
// PositionalWritesStorageTest, RenameStorageTest, DirectoryStorageTest, PublishStorageTest.
//
// What a capability selects (storage.h says what each promises):
//   positional_writes  WriteAt at any offset, in any order, into a file that exists in place
//                      while it is written (readers see it; removing it keeps it open)
//   rename             Rename, RenameNoReplace, and a Publish built on them
//   directory_sync     directories that exist by themselves (empty ones too), a parent that
//                      must exist, SyncDir that checks what it syncs
//   conditional_create Publish: create-only (one winner among racing creators) and replace
//
// The cases are registered with ::testing::RegisterTest rather than declared with TEST_P, so
// that this header may be included by any number of files of one test program (tessera's own
// storage tests instantiate the suite in two), and a store's factory may be any callable.
// Header-only: it needs tessera's public headers and GoogleTest (gtest and gmock), nothing else.
#ifndef TESSERA_TESTING_STORAGE_SUITE_H_
#define TESSERA_TESTING_STORAGE_SUITE_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/status.h"
#include "tessera/storage.h"
#include "tessera/testing/gtest_status.h"

namespace tessera::testing {

// Sizes in the suite cross multiples of this, at offsets that are not: a store that splits
// large reads and writes should be instantiated with this as its largest single I/O (e.g.
// PosixStorageOptions::max_io_bytes), so that its splitting is tested. Not a power of two.
inline constexpr size_t kStorageSuiteMaxIoBytes = 4000;

// The store under test for one case: a Storage and a directory in it that the case may fill
// (it exists and is empty). The destructor runs after the case: it cleans up, and may check
// what the case left behind with gtest's EXPECT_* (an upload not finished, a fault fired).
class StorageSuiteEnv {
 public:
  virtual ~StorageSuiteEnv() = default;
  virtual Storage& storage() = 0;
  virtual const std::string& root() const = 0;
};

// A StorageSuiteEnv that holds a store and a root, and checks and cleans nothing.
class SimpleStorageSuiteEnv : public StorageSuiteEnv {
 public:
  SimpleStorageSuiteEnv(std::shared_ptr<Storage> storage, std::string root)
      : storage_(std::move(storage)), root_(std::move(root)) {}
  Storage& storage() override { return *storage_; }
  const std::string& root() const override { return root_; }

 private:
  std::shared_ptr<Storage> storage_;
  std::string root_;
};

// Makes a fresh environment for each case; an error fails the case (it never skips it).
using StorageSuiteFactory = std::function<Result<std::unique_ptr<StorageSuiteEnv>>()>;

// ---- helpers, also for a store's own tests -------------------------------------------------

// `n` bytes that depend on `seed`.
inline std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

// Writes `contents` as the whole file `path`, syncs and closes it.
inline Status WriteFile(Storage& storage, const std::string& path, const std::string& contents,
                        CreateMode mode = CreateMode::kExclusive) {
  TESSERA_ASSIGN_OR_RETURN(auto file, storage.NewWritableFile(path, mode));
  TESSERA_RETURN_IF_ERROR(file->WriteAt(0, contents.data(), contents.size()));
  TESSERA_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

inline Result<std::string> ReadFile(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(auto file, storage.NewReadableFile(path));
  std::string out(file->size(), '\0');
  TESSERA_RETURN_IF_ERROR(file->ReadAt(0, out.data(), out.size()));
  return out;
}

inline std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// The names in `dir` that are Publish's temporaries (PublishTemporaryName).
inline std::vector<std::string> Temporaries(Storage& storage, const std::string& dir) {
  std::vector<std::string> out;
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (!names.ok()) return out;
  for (const std::string& n : *names) {
    if (ParsePublishTemporaryName(n, nullptr)) out.push_back(n);
  }
  return out;
}

// ---- the fixture ---------------------------------------------------------------------------

// What one instantiation of the suite was given.
struct StorageSuiteParams {
  std::string name;
  StorageSuiteFactory factory;
  StorageCapabilities capabilities;
};

// The fixture of every case: a fresh environment from the factory, whose store claims exactly
// the capabilities the suite was instantiated with.
class StorageSuiteTest : public ::testing::Test {
 public:
  explicit StorageSuiteTest(StorageSuiteParams params) : params_(std::move(params)) {}

 protected:
  void SetUp() override {
    Result<std::unique_ptr<StorageSuiteEnv>> env = params_.factory();
    ASSERT_TRUE(env.ok()) << params_.name
                          << " storage could not be set up: " << env.status().ToString();
    ASSERT_NE(*env, nullptr) << params_.name << ": the factory returned no environment";
    env_ = std::move(*env);
    const StorageCapabilities want = params_.capabilities;
    const StorageCapabilities got = storage().capabilities();
    ASSERT_TRUE(want.rename == got.rename && want.positional_writes == got.positional_writes &&
                want.directory_sync == got.directory_sync &&
                want.conditional_create == got.conditional_create)
        << params_.name << ": capabilities() differ from what the suite selects cases by";
  }
  void TearDown() override { env_.reset(); }

  Storage& storage() { return env_->storage(); }
  const std::string& root() const { return env_->root(); }
  std::string Path(const std::string& name) const { return JoinPath(env_->root(), name); }
  const StorageCapabilities& declared_capabilities() const { return params_.capabilities; }

 private:
  StorageSuiteParams params_;
  std::unique_ptr<StorageSuiteEnv> env_;
};

// ---- the cases -----------------------------------------------------------------------------

namespace storage_cases {

inline constexpr CreateMode kExclusiveMode = CreateMode::kExclusive;

// Defines the case `name`: a StorageSuiteTest whose body follows the macro.
#define TESSERA_STORAGE_SUITE_CASE(name)                             \
  class name final : public ::tessera::testing::StorageSuiteTest {   \
   public:                                                           \
    explicit name(::tessera::testing::StorageSuiteParams params)     \
        : ::tessera::testing::StorageSuiteTest(std::move(params)) {} \
    void TestBody() override;                                        \
  };                                                                 \
  inline void name::TestBody()

TESSERA_STORAGE_SUITE_CASE(WriteReadRoundTripAtOffsets) {
  const std::string path = Path("f");
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  EXPECT_EQ(w->path(), path);
  TESSERA_ASSERT_OK(w->WriteAt(0, "hello ", 6));
  TESSERA_ASSERT_OK(w->WriteAt(6, "world", 5));
  TESSERA_ASSERT_OK(w->WriteAt(0, "J", 1));  // overwrite in place
  TESSERA_ASSERT_OK(w->Sync());
  TESSERA_ASSERT_OK(w->Close());

  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  EXPECT_EQ(r->path(), path);
  ASSERT_EQ(r->size(), 11u);
  char buf[16] = {};
  TESSERA_ASSERT_OK(r->ReadAt(0, buf, 11));
  EXPECT_EQ(std::string(buf, 11), "Jello world");
  TESSERA_ASSERT_OK(r->ReadAt(6, buf, 5));
  EXPECT_EQ(std::string(buf, 5), "world");
  TESSERA_ASSERT_OK(r->ReadAt(3, buf, 4));
  EXPECT_EQ(std::string(buf, 4), "lo w");
}

TESSERA_STORAGE_SUITE_CASE(LargeWriteAndReadCrossMaxIoBytes) {
  // Many times kStorageSuiteMaxIoBytes, at an offset that is not a multiple of it.
  const std::vector<uint8_t> data = Pattern(25 * kStorageSuiteMaxIoBytes + 123, 7);
  const uint64_t offset = 1001;
  const std::string path = Path("large");
  {
    TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
    TESSERA_ASSERT_OK(w->WriteAt(0, data.data(), offset));  // some prefix
    TESSERA_ASSERT_OK(w->WriteAt(offset, data.data(), data.size()));
    TESSERA_ASSERT_OK(w->Close());
  }
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  ASSERT_EQ(r->size(), offset + data.size());
  std::vector<uint8_t> back(data.size());
  TESSERA_ASSERT_OK(r->ReadAt(offset, back.data(), back.size()));
  EXPECT_TRUE(back == data) << "large read differs";
  // A read that straddles several max_io_bytes boundaries at odd offsets.
  const size_t mid = 3 * kStorageSuiteMaxIoBytes - 17;
  std::vector<uint8_t> part(5 * kStorageSuiteMaxIoBytes + 3);
  TESSERA_ASSERT_OK(r->ReadAt(offset + mid, part.data(), part.size()));
  EXPECT_TRUE(std::equal(part.begin(), part.end(), data.begin() + mid));
}

TESSERA_STORAGE_SUITE_CASE(SparseOutOfOrderWritesZeroFillGaps) {
  const std::string path = Path("sparse");
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  TESSERA_ASSERT_OK(w->WriteAt(100, "tail", 4));
  TESSERA_ASSERT_OK(w->WriteAt(10, "mid", 3));
  TESSERA_ASSERT_OK(w->WriteAt(0, "head", 4));
  TESSERA_ASSERT_OK(w->Close());
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  std::string want(104, '\0');
  want.replace(0, 4, "head");
  want.replace(10, 3, "mid");
  want.replace(100, 4, "tail");
  EXPECT_EQ(got, want);
}

TESSERA_STORAGE_SUITE_CASE(ReadPastEndIsDataLossNamingPathAndSize) {
  const std::string path = Path("short");
  TESSERA_ASSERT_OK(WriteFile(storage(), path, "0123456789"));
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  char buf[32];
  const Status s = r->ReadAt(5, buf, 10);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), ::testing::HasSubstr(path));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("offset 5"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("length 10"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("size 10"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("truncated?"));
  // Offsets near 2^64 must not wrap around.
  EXPECT_EQ(r->ReadAt(~uint64_t{0} - 2, buf, 8).code(), StatusCode::kDataLoss);
  EXPECT_EQ(r->ReadAt(11, buf, 0).code(), StatusCode::kDataLoss);
  // Up to the end is fine, including an empty read there.
  TESSERA_EXPECT_OK(r->ReadAt(0, buf, 10));
  TESSERA_EXPECT_OK(r->ReadAt(10, buf, 0));
}

TESSERA_STORAGE_SUITE_CASE(ReaderSizeIsSizeAtOpen) {
  const std::string path = Path("grows");
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  TESSERA_ASSERT_OK(w->WriteAt(0, "abcd", 4));
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  TESSERA_ASSERT_OK(w->WriteAt(4, "efgh", 4));
  EXPECT_EQ(r->size(), 4u);
  char buf[8];
  EXPECT_EQ(r->ReadAt(0, buf, 8).code(), StatusCode::kDataLoss);
  TESSERA_ASSIGN_OR_FAIL(auto r2, storage().NewReadableFile(path));
  EXPECT_EQ(r2->size(), 8u);
}

TESSERA_STORAGE_SUITE_CASE(ReadOfFileTruncatedAfterOpenIsDataLoss) {
  const std::string path = Path("trunc");
  TESSERA_ASSERT_OK(WriteFile(storage(), path, std::string(100, 'x')));
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path, CreateMode::kTruncate));
  char buf[10];
  const Status s = r->ReadAt(50, buf, 10);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), ::testing::HasSubstr(path));
}

// Mapping a file that shrank after it was opened is an error, never a mapping past its end
// (whose pages would raise SIGBUS when touched).
TESSERA_STORAGE_SUITE_CASE(MapOfFileTruncatedAfterOpenFails) {
  const std::string path = Path("shrinks");
  TESSERA_ASSERT_OK(WriteFile(storage(), path, std::string(3 << 20, 'x')));
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path, CreateMode::kTruncate));
  const Result<FileMapping> m = r->Map(1 << 20, 1 << 20);
  ASSERT_FALSE(m.ok());
  if (m.status().code() == StatusCode::kUnimplemented) return;
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss) << m.status().ToString();
  EXPECT_THAT(m.status().message(), ::testing::HasSubstr("shrank to 0 bytes"));
  EXPECT_THAT(m.status().message(), ::testing::HasSubstr(path));
}

TESSERA_STORAGE_SUITE_CASE(TruncateModeTruncatesExistingFile) {
  const std::string path = Path("t");
  TESSERA_ASSERT_OK(WriteFile(storage(), path, "long old contents"));
  TESSERA_ASSERT_OK(WriteFile(storage(), path, "new", CreateMode::kTruncate));
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "new");
}

// Issue 11, item 5: the default, exclusive creation, refuses every name that exists: an error
// naming it, and the existing file untouched.
TESSERA_STORAGE_SUITE_CASE(ExclusiveCreateRefusesAnExistingFile) {
  const std::string path = Path("taken");
  TESSERA_ASSERT_OK(WriteFile(storage(), path, "precious"));
  for (const CreateMode* mode : {static_cast<const CreateMode*>(nullptr), &kExclusiveMode}) {
    auto w = mode ? storage().NewWritableFile(path, *mode) : storage().NewWritableFile(path);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), StatusCode::kAlreadyExists) << w.status().ToString();
    EXPECT_THAT(w.status().message(), ::testing::HasSubstr(path));
  }
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "precious");
}

// kExclusiveNewName never writes over a name that exists either: the store may refuse it at
// NewWritableFile or at Close (an object store checks at the create-only completion), always
// kAlreadyExists naming it, the existing file untouched.
TESSERA_STORAGE_SUITE_CASE(ExclusiveNewNameRefusesAnExistingFileAtOpenOrClose) {
  const std::string path = Path("taken");
  TESSERA_ASSERT_OK(WriteFile(storage(), path, "precious"));
  const Status written = WriteFile(storage(), path, "overwritten!", CreateMode::kExclusiveNewName);
  EXPECT_EQ(written.code(), StatusCode::kAlreadyExists) << written.ToString();
  EXPECT_THAT(written.message(), ::testing::HasSubstr(path));
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "precious");
  // A new name is created as by kExclusive.
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("fresh"), "new", CreateMode::kExclusiveNewName));
  TESSERA_ASSIGN_OR_FAIL(std::string fresh, ReadFile(storage(), Path("fresh")));
  EXPECT_EQ(fresh, "new");
}

// NewReadableFileWithPrefix opens the same file as NewReadableFile, whatever the prefix asked
// for: the same size, the same bytes read within the prefix, across its end and past it, an
// empty file, and kNotFound naming a missing path.
TESSERA_STORAGE_SUITE_CASE(AFileOpenedWithItsPrefixReadsLikeAnyOther) {
  std::string contents(10000, '\0');
  for (size_t i = 0; i < contents.size(); ++i) contents[i] = static_cast<char>('a' + i % 23);
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("f"), contents));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("empty"), ""));
  for (size_t prefix : {size_t{0}, size_t{8}, size_t{4096}, contents.size(), size_t{1} << 20}) {
    TESSERA_ASSIGN_OR_FAIL(std::unique_ptr<ReadableFile> file,
                           storage().NewReadableFileWithPrefix(Path("f"), prefix));
    EXPECT_EQ(file->size(), contents.size()) << prefix;
    for (auto [offset, n] : std::vector<std::pair<size_t, size_t>>{
             {0, 8}, {8, 4088}, {4090, 20}, {9999, 1}, {0, contents.size()}, {5000, 0}}) {
      std::string got(n, '\0');
      TESSERA_EXPECT_OK(file->ReadAt(offset, got.data(), n));
      EXPECT_EQ(got, contents.substr(offset, n)) << prefix << " at " << offset;
    }
    char past[4];
    EXPECT_EQ(file->ReadAt(contents.size() - 2, past, sizeof(past)).code(), StatusCode::kDataLoss);
    TESSERA_ASSIGN_OR_FAIL(std::unique_ptr<ReadableFile> empty,
                           storage().NewReadableFileWithPrefix(Path("empty"), prefix));
    EXPECT_EQ(empty->size(), 0u);
    auto missing = storage().NewReadableFileWithPrefix(Path("missing"), prefix);
    ASSERT_FALSE(missing.ok());
    EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
    EXPECT_THAT(missing.status().message(), ::testing::HasSubstr(Path("missing")));
  }
}

// RemoveIfPresent removes a file, is OK where there is none, and never removes a directory
// or what lies under it (an error, or nothing done where a directory is a key prefix).
TESSERA_STORAGE_SUITE_CASE(RemoveIfPresentRemovesAFileAndToleratesAMissingOne) {
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("f"), "x"));
  TESSERA_ASSERT_OK(storage().RemoveIfPresent(Path("f")));
  TESSERA_ASSIGN_OR_FAIL(FileType gone, storage().Stat(Path("f")));
  EXPECT_EQ(gone, FileType::kNotFound);
  TESSERA_EXPECT_OK(storage().RemoveIfPresent(Path("f")));
  TESSERA_EXPECT_OK(storage().RemoveIfPresent(Path("never")));
  TESSERA_ASSERT_OK(storage().CreateDirs(Path("d")));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("d/inside"), "y"));
  storage().RemoveIfPresent(Path("d")).IgnoreError();
  TESSERA_ASSIGN_OR_FAIL(std::string inside, ReadFile(storage(), Path("d/inside")));
  EXPECT_EQ(inside, "y");
}

TESSERA_STORAGE_SUITE_CASE(ExclusiveCreateRefusesADirectory) {
  const std::string dir = Path("dir");
  TESSERA_ASSERT_OK(storage().CreateDirs(dir));
  auto w = storage().NewWritableFile(dir);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kAlreadyExists) << w.status().ToString();
  TESSERA_ASSIGN_OR_FAIL(FileType type, storage().Stat(dir));
  EXPECT_EQ(type, FileType::kDirectory);
}

TESSERA_STORAGE_SUITE_CASE(MissingPathsAreNotFound) {
  const std::string missing = Path("missing");
  auto r = storage().NewReadableFile(missing);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
  EXPECT_THAT(r.status().message(), ::testing::HasSubstr(missing));
  EXPECT_THAT(r.status().message(), ::testing::HasSubstr(std::strerror(ENOENT)));

  const std::string in_missing_dir = Path("nodir/x");
  auto w = storage().NewWritableFile(in_missing_dir);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound) << w.status().ToString();
  EXPECT_THAT(w.status().message(), ::testing::HasSubstr(in_missing_dir));

  const Status removed = storage().Remove(missing);
  EXPECT_EQ(removed.code(), StatusCode::kNotFound) << removed.ToString();
  EXPECT_THAT(removed.message(), ::testing::HasSubstr(missing));

  const Status renamed = storage().Rename(missing, Path("other"));
  EXPECT_EQ(renamed.code(), StatusCode::kNotFound) << renamed.ToString();
  EXPECT_THAT(renamed.message(), ::testing::HasSubstr(missing));

  auto listed = storage().ListDir(missing);
  ASSERT_FALSE(listed.ok());
  EXPECT_EQ(listed.status().code(), StatusCode::kNotFound) << listed.status().ToString();
  EXPECT_THAT(listed.status().message(), ::testing::HasSubstr(missing));

  EXPECT_EQ(storage().SyncDir(missing).code(), StatusCode::kNotFound);
}

TESSERA_STORAGE_SUITE_CASE(CreateDirsIsNestedAndIdempotent) {
  const std::string deep = Path("a/b/c");
  TESSERA_ASSERT_OK(storage().CreateDirs(deep));
  TESSERA_ASSERT_OK(storage().CreateDirs(deep));
  TESSERA_ASSERT_OK(storage().CreateDirs(Path("a/b")));
  TESSERA_ASSERT_OK(storage().CreateDirs(Path("a/b/c/")));
  for (const char* d : {"a", "a/b", "a/b/c"}) {
    TESSERA_ASSIGN_OR_FAIL(FileType type, storage().Stat(Path(d)));
    EXPECT_EQ(type, FileType::kDirectory) << d;
  }
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("a/b/c/f"), "x"));
  TESSERA_ASSIGN_OR_FAIL(auto names, storage().ListDir(Path("a")));
  EXPECT_THAT(names, ::testing::ElementsAre("b"));
  TESSERA_ASSIGN_OR_FAIL(auto empty, storage().ListDir(Path("a/b/c/")));
  EXPECT_THAT(empty, ::testing::ElementsAre("f"));
}

TESSERA_STORAGE_SUITE_CASE(CreateDirsThroughAFileFails) {
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("file"), "x"));
  const Status over = storage().CreateDirs(Path("file"));
  EXPECT_EQ(over.code(), StatusCode::kIOError) << over.ToString();
  EXPECT_THAT(over.message(), ::testing::HasSubstr(Path("file")));
  EXPECT_FALSE(storage().CreateDirs(Path("file/sub")).ok());
}

TESSERA_STORAGE_SUITE_CASE(StatReportsTheType) {
  TESSERA_ASSERT_OK(storage().CreateDirs(Path("d")));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("d/f"), "x"));
  TESSERA_ASSIGN_OR_FAIL(FileType file, storage().Stat(Path("d/f")));
  EXPECT_EQ(file, FileType::kFile);
  TESSERA_ASSIGN_OR_FAIL(FileType dir, storage().Stat(Path("d")));
  EXPECT_EQ(dir, FileType::kDirectory);
  TESSERA_ASSIGN_OR_FAIL(FileType missing, storage().Stat(Path("d/nope")));
  EXPECT_EQ(missing, FileType::kNotFound);
  TESSERA_ASSIGN_OR_FAIL(FileType under_file, storage().Stat(Path("d/f/g")));
  EXPECT_EQ(under_file, FileType::kNotFound);
}

TESSERA_STORAGE_SUITE_CASE(ListDirIsSortedWithoutDotEntries) {
  TESSERA_ASSIGN_OR_FAIL(auto none, storage().ListDir(root()));
  EXPECT_THAT(none, ::testing::IsEmpty());
  for (const char* name : {"c2", "b", "c10", "a", "B"}) {
    TESSERA_ASSERT_OK(WriteFile(storage(), Path(name), name));
  }
  TESSERA_ASSERT_OK(storage().CreateDirs(Path("d")));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("d/in"), "x"));  // a directory everywhere
  TESSERA_ASSIGN_OR_FAIL(auto names, storage().ListDir(root()));
  EXPECT_THAT(names, ::testing::ElementsAre("B", "a", "b", "c10", "c2", "d"));
  // A file is not a directory.
  auto of_file = storage().ListDir(Path("a"));
  ASSERT_FALSE(of_file.ok());
  EXPECT_EQ(of_file.status().code(), StatusCode::kIOError) << of_file.status().ToString();
}

TESSERA_STORAGE_SUITE_CASE(RenameReplacesTheTarget) {
  const std::string target = Path("manifest");
  const std::string tmp = Path("manifest.tmp");
  TESSERA_ASSERT_OK(WriteFile(storage(), target, "old"));
  TESSERA_ASSERT_OK(WriteFile(storage(), tmp, "new contents"));
  TESSERA_ASSERT_OK(storage().Rename(tmp, target));
  TESSERA_ASSERT_OK(storage().SyncDir(root()));
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), target));
  EXPECT_EQ(got, "new contents");
  TESSERA_ASSIGN_OR_FAIL(FileType tmp_type, storage().Stat(tmp));
  EXPECT_EQ(tmp_type, FileType::kNotFound);
  TESSERA_ASSIGN_OR_FAIL(auto names, storage().ListDir(root()));
  EXPECT_THAT(names, ::testing::ElementsAre("manifest"));
}

TESSERA_STORAGE_SUITE_CASE(RenameMovesADirectoryWithItsContents) {
  TESSERA_ASSERT_OK(storage().CreateDirs(Path("src/sub")));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("src/sub/f"), "payload"));
  TESSERA_ASSERT_OK(storage().Rename(Path("src"), Path("dst")));
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), Path("dst/sub/f")));
  EXPECT_EQ(got, "payload");
  TESSERA_ASSIGN_OR_FAIL(FileType old_type, storage().Stat(Path("src")));
  EXPECT_EQ(old_type, FileType::kNotFound);
}

TESSERA_STORAGE_SUITE_CASE(RemoveDeletesAFileButNotADirectory) {
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("gone"), "x"));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("kept"), "y"));
  TESSERA_ASSERT_OK(storage().Remove(Path("gone")));
  TESSERA_ASSIGN_OR_FAIL(FileType type, storage().Stat(Path("gone")));
  EXPECT_EQ(type, FileType::kNotFound);
  TESSERA_ASSIGN_OR_FAIL(auto names, storage().ListDir(root()));
  EXPECT_THAT(names, ::testing::ElementsAre("kept"));
  EXPECT_EQ(storage().Remove(Path("gone")).code(), StatusCode::kNotFound);

  TESSERA_ASSERT_OK(storage().CreateDirs(Path("dir")));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("dir/f"), "z"));  // a directory everywhere
  EXPECT_EQ(storage().Remove(Path("dir")).code(), StatusCode::kIOError);
}

TESSERA_STORAGE_SUITE_CASE(RemoveDirRemovesOnlyAnEmptyDirectory) {
  TESSERA_ASSERT_OK(storage().CreateDirs(Path("full")));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("full/f"), "x"));
  const Status not_empty = storage().RemoveDir(Path("full"));
  EXPECT_EQ(not_empty.code(), StatusCode::kIOError);
  EXPECT_NE(not_empty.message().find(Path("full")), std::string::npos) << not_empty.ToString();
  EXPECT_EQ(storage().RemoveDir(Path("full/f")).code(), StatusCode::kIOError);  // a file
  TESSERA_ASSERT_OK(storage().Remove(Path("full/f")));
  TESSERA_ASSERT_OK(storage().RemoveDir(Path("full")));
  TESSERA_ASSIGN_OR_FAIL(FileType type, storage().Stat(Path("full")));
  EXPECT_EQ(type, FileType::kNotFound);
  EXPECT_EQ(storage().RemoveDir(Path("full")).code(), StatusCode::kNotFound);
}

TESSERA_STORAGE_SUITE_CASE(DuplicateSlashesAndDotsNameTheSameFile) {
  TESSERA_ASSERT_OK(storage().CreateDirs(Path("d")));
  TESSERA_ASSERT_OK(WriteFile(storage(), root() + "/d//x", "same"));
  for (const std::string& alias : {Path("d/x"), root() + "//d/./x"}) {
    TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), alias));
    EXPECT_EQ(got, "same") << alias;
  }
  TESSERA_ASSIGN_OR_FAIL(auto names, storage().ListDir(Path("d/")));
  EXPECT_THAT(names, ::testing::ElementsAre("x"));
}

TESSERA_STORAGE_SUITE_CASE(OpenWritableFileFollowsItsInodeAcrossRename) {
  const std::string tmp = Path("f.tmp");
  const std::string final_path = Path("f");
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(tmp));
  TESSERA_ASSERT_OK(w->WriteAt(0, "abc", 3));
  TESSERA_ASSERT_OK(storage().Rename(tmp, final_path));
  TESSERA_ASSERT_OK(w->WriteAt(3, "def", 3));
  TESSERA_ASSERT_OK(w->Sync());
  TESSERA_ASSERT_OK(w->Close());
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), final_path));
  EXPECT_EQ(got, "abcdef");
  TESSERA_ASSIGN_OR_FAIL(FileType tmp_type, storage().Stat(tmp));
  EXPECT_EQ(tmp_type, FileType::kNotFound);
}

TESSERA_STORAGE_SUITE_CASE(OpenFilesKeepWorkingAfterRemove) {
  const std::string path = Path("unlinked");
  TESSERA_ASSERT_OK(WriteFile(storage(), path, "still here"));
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(Path("w")));
  TESSERA_ASSERT_OK(storage().Remove(path));
  TESSERA_ASSERT_OK(storage().Remove(Path("w")));
  char buf[10];
  TESSERA_ASSERT_OK(r->ReadAt(0, buf, 10));
  EXPECT_EQ(std::string(buf, 10), "still here");
  TESSERA_EXPECT_OK(w->WriteAt(0, "x", 1));
  TESSERA_EXPECT_OK(w->Sync());
}

TESSERA_STORAGE_SUITE_CASE(CloseIsIdempotentAndLaterWritesFail) {
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(Path("c")));
  TESSERA_ASSERT_OK(w->WriteAt(0, "x", 1));
  TESSERA_ASSERT_OK(w->Close());
  TESSERA_ASSERT_OK(w->Close());
  const Status write = w->WriteAt(1, "y", 1);
  EXPECT_FALSE(write.ok());
  EXPECT_THAT(write.message(), ::testing::HasSubstr(Path("c")));
  EXPECT_FALSE(w->Sync().ok());
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), Path("c")));
  EXPECT_EQ(got, "x");
}

TESSERA_STORAGE_SUITE_CASE(SyncDirOfAFileFails) {
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("f"), "x"));
  TESSERA_EXPECT_OK(storage().SyncDir(root()));
  EXPECT_EQ(storage().SyncDir(Path("f")).code(), StatusCode::kIOError);
}

TESSERA_STORAGE_SUITE_CASE(ConcurrentWriteAtOfDisjointRanges) {
  constexpr int kThreads = 8;
  constexpr int kBlocksPerThread = 16;
  constexpr size_t kBlock = kStorageSuiteMaxIoBytes + 999;  // each write is split on posix
  const std::vector<uint8_t> data = Pattern(kThreads * kBlocksPerThread * kBlock, 42);
  const std::string path = Path("concurrent");
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
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
  for (const Status& s : results) TESSERA_EXPECT_OK(s);
  TESSERA_ASSERT_OK(w->Close());
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  ASSERT_EQ(r->size(), data.size());
  std::vector<uint8_t> back(data.size());
  TESSERA_ASSERT_OK(r->ReadAt(0, back.data(), back.size()));
  EXPECT_TRUE(back == data) << "concurrent writes lost or misplaced bytes";
}

TESSERA_STORAGE_SUITE_CASE(ConcurrentFileCreationInOneDirectory) {
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
  for (const Status& s : results) TESSERA_EXPECT_OK(s);
  TESSERA_ASSIGN_OR_FAIL(auto names, storage().ListDir(root()));
  EXPECT_EQ(names.size(), static_cast<size_t>(kThreads * kFilesPerThread));
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), Path("f3_24.done")));
  EXPECT_EQ(got, "f3_24");
}

// StartWriteback is a hint: it changes no byte, and Sync still makes them durable.
TESSERA_STORAGE_SUITE_CASE(StartWritebackKeepsTheBytes) {
  const std::vector<uint8_t> data = Pattern(3 << 20, 5);
  const std::string path = Path("streamed");
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
  TESSERA_ASSERT_OK(w->WriteAt(0, data.data(), data.size() / 2));
  TESSERA_ASSERT_OK(w->StartWriteback(0, data.size() / 2));
  TESSERA_ASSERT_OK(w->WriteAt(data.size() / 2, data.data() + data.size() / 2, data.size() / 2));
  TESSERA_ASSERT_OK(w->StartWriteback(data.size() / 2, data.size() / 2));
  TESSERA_ASSERT_OK(w->StartWriteback(data.size(), 4096));  // past the end: nothing to do
  TESSERA_ASSERT_OK(w->Sync());
  TESSERA_ASSERT_OK(w->Close());
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_TRUE(got.size() == data.size() && std::memcmp(got.data(), data.data(), got.size()) == 0);
}

// CopyFrom puts exactly the source's bytes at the destination offset, in calls that cross
// max_io_bytes at odd offsets, and reports a source range past the end like ReadAt.
TESSERA_STORAGE_SUITE_CASE(CopyFromCopiesTheRangeAndRefusesPastTheEnd) {
  const std::vector<uint8_t> data = Pattern(25 * kStorageSuiteMaxIoBytes + 123, 17);
  const std::string from = Path("from"), to = Path("to");
  {
    TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(from));
    TESSERA_ASSERT_OK(w->WriteAt(0, data.data(), data.size()));
    TESSERA_ASSERT_OK(w->Close());
  }
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(from));
  TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(to));
  TESSERA_ASSERT_OK(w->WriteAt(0, "head", 4));
  const uint64_t src_offset = 1001, n = 20 * kStorageSuiteMaxIoBytes + 7;
  TESSERA_ASSERT_OK(w->CopyFrom(*r, src_offset, 4, n));
  TESSERA_ASSERT_OK(w->CopyFrom(*r, 0, 4 + n, 3));  // a few bytes after, from the start
  TESSERA_ASSERT_OK(w->CopyFrom(*r, data.size(), 4 + n + 3, 0));  // nothing, at the end
  const Status past = w->CopyFrom(*r, data.size() - 5, 0, 10);
  EXPECT_EQ(past.code(), StatusCode::kDataLoss) << past.ToString();
  EXPECT_THAT(past.message(), ::testing::HasSubstr(from));
  EXPECT_THAT(past.message(), ::testing::HasSubstr("size " + std::to_string(data.size())));
  TESSERA_ASSERT_OK(w->Sync());
  TESSERA_ASSERT_OK(w->Close());
  EXPECT_FALSE(w->CopyFrom(*r, 0, 0, 1).ok());  // closed
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), to));
  std::string want = "head";
  want.append(data.begin() + src_offset, data.begin() + src_offset + n);
  want.append(data.begin(), data.begin() + 3);
  EXPECT_TRUE(got == want) << "copied bytes differ (" << got.size() << " bytes, want "
                           << want.size() << ")";
}

// Map is optional: a storage either declines with kUnimplemented or shows exactly the bytes
// ReadAt returns, at any offset, and rejects ranges past the end like ReadAt.
TESSERA_STORAGE_SUITE_CASE(MapShowsTheBytesOfReadAtOrIsUnimplemented) {
  const std::vector<uint8_t> data = Pattern(3 * 4096 + 777, 11);
  const std::string path = Path("mapped");
  {
    TESSERA_ASSIGN_OR_FAIL(auto w, storage().NewWritableFile(path));
    TESSERA_ASSERT_OK(w->WriteAt(0, data.data(), data.size()));
    TESSERA_ASSERT_OK(w->Close());
  }
  TESSERA_ASSIGN_OR_FAIL(auto r, storage().NewReadableFile(path));
  Result<FileMapping> probe = r->Map(0, data.size());
  if (!probe.ok()) {
    EXPECT_EQ(probe.status().code(), StatusCode::kUnimplemented) << probe.status().ToString();
    return;
  }
  const std::pair<uint64_t, size_t> ranges[] = {
      {0, data.size()}, {1, 10}, {4095, 2}, {4096, 4096}, {5000, 8000}, {data.size() - 1, 1}};
  for (const auto& [offset, n] : ranges) {
    TESSERA_ASSIGN_OR_FAIL(FileMapping m, r->Map(offset, n));
    ASSERT_EQ(m.bytes().size(), n) << "offset " << offset;
    EXPECT_EQ(std::memcmp(m.bytes().data(), data.data() + offset, n), 0) << "offset " << offset;
  }
  TESSERA_ASSIGN_OR_FAIL(FileMapping empty, r->Map(data.size(), 0));
  EXPECT_TRUE(empty.bytes().empty());
  const Result<FileMapping> past = r->Map(data.size() - 5, 10);
  EXPECT_EQ(past.status().code(), StatusCode::kDataLoss) << past.status().ToString();
  EXPECT_THAT(past.status().message(), ::testing::HasSubstr(path));
  EXPECT_THAT(past.status().message(), ::testing::HasSubstr("size " + std::to_string(data.size())));
  EXPECT_EQ(r->Map(~uint64_t{0} - 2, 8).status().code(), StatusCode::kDataLoss);
  // A mapping stays readable after its file object is gone and the file is removed.
  TESSERA_ASSIGN_OR_FAIL(FileMapping kept, r->Map(100, 200));
  r.reset();
  TESSERA_ASSERT_OK(storage().Remove(path));
  EXPECT_EQ(std::memcmp(kept.bytes().data(), data.data() + 100, 200), 0);
}

// ---- Publish: the one commit operation (stores with conditional_create) ---------------------

// A store claims exactly the capabilities the suite instantiates it with (so no case that its
// capabilities select is left out, and none it cannot pass is run).
TESSERA_STORAGE_SUITE_CASE(CapabilitiesAreTheOnesDeclared) {
  const StorageCapabilities c = storage().capabilities();
  const StorageCapabilities& want = declared_capabilities();
  EXPECT_EQ(c.rename, want.rename);
  EXPECT_EQ(c.positional_writes, want.positional_writes);
  EXPECT_EQ(c.directory_sync, want.directory_sync);
  EXPECT_EQ(c.conditional_create, want.conditional_create);
}

TESSERA_STORAGE_SUITE_CASE(CreateOnlyCreatesOnceAndRefusesAnExistingName) {
  const std::string path = Path("index");
  for (bool sync : {true, false}) {
    SCOPED_TRACE(sync ? "sync" : "no sync");
    TESSERA_ASSERT_OK(storage().Publish(path, AsBytes("first"), PublishMode::kCreateOnly, sync));
    TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
    EXPECT_EQ(got, "first");
    const Status again = storage().Publish(path, AsBytes("second"), PublishMode::kCreateOnly, sync);
    EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.ToString();
    EXPECT_THAT(again.message(), ::testing::HasSubstr(path));
    TESSERA_ASSIGN_OR_FAIL(got, ReadFile(storage(), path));
    EXPECT_EQ(got, "first");
    EXPECT_THAT(Temporaries(storage(), root()), ::testing::IsEmpty());
    TESSERA_ASSERT_OK(storage().Remove(path));
  }
}

TESSERA_STORAGE_SUITE_CASE(ReplaceReplacesWholeAndCreatesWhenMissing) {
  const std::string path = Path("pointer");
  TESSERA_ASSERT_OK(storage().Publish(path, AsBytes("one"), PublishMode::kReplace, true));
  TESSERA_ASSERT_OK(
      storage().Publish(path, AsBytes("a longer second"), PublishMode::kReplace, false));
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "a longer second");
  TESSERA_ASSERT_OK(storage().Publish(path, AsBytes(""), PublishMode::kReplace, true));
  TESSERA_ASSIGN_OR_FAIL(got, ReadFile(storage(), path));
  EXPECT_EQ(got, "");
  TESSERA_ASSIGN_OR_FAIL(auto names, storage().ListDir(root()));
  EXPECT_THAT(names, ::testing::ElementsAre("pointer"));
}

// What a killed attempt left (its temporary, synced or not) never blocks a later Publish.
TESSERA_STORAGE_SUITE_CASE(PublishIsNotBlockedByTheTemporaryOfAKilledAttempt) {
  const std::string path = Path("marker");
  const std::string leftover = PublishTemporaryName(path);
  TESSERA_ASSERT_OK(WriteFile(storage(), leftover, "half"));
  std::string target;
  ASSERT_TRUE(
      ParsePublishTemporaryName(std::filesystem::path(leftover).filename().string(), &target));
  EXPECT_EQ(target, "marker");
  TESSERA_ASSERT_OK(storage().Publish(path, AsBytes("whole"), PublishMode::kCreateOnly, true));
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
  EXPECT_EQ(got, "whole");
  EXPECT_EQ(Temporaries(storage(), root()).size(), 1u) << "the leftover, untouched";
}

// Of several threads creating one name at once, exactly one wins and its bytes are the file.
TESSERA_STORAGE_SUITE_CASE(CreateOnlyRacingCreatorsExactlyOneWins) {
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
    TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), path));
    EXPECT_EQ(got, std::string(1000 + winner, static_cast<char>('a' + winner)));
  }
  EXPECT_THAT(Temporaries(storage(), root()), ::testing::IsEmpty());
}

TESSERA_STORAGE_SUITE_CASE(RenameNoReplaceMovesOnlyOntoAFreeName) {
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("a"), "A"));
  TESSERA_ASSERT_OK(WriteFile(storage(), Path("b"), "B"));
  const Status taken = storage().RenameNoReplace(Path("a"), Path("b"));
  EXPECT_EQ(taken.code(), StatusCode::kAlreadyExists) << taken.ToString();
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(storage(), Path("b")));
  EXPECT_EQ(got, "B");
  TESSERA_ASSERT_OK(storage().RenameNoReplace(Path("a"), Path("c")));
  TESSERA_ASSIGN_OR_FAIL(got, ReadFile(storage(), Path("c")));
  EXPECT_EQ(got, "A");
  EXPECT_EQ(storage().RenameNoReplace(Path("a"), Path("d")).code(), StatusCode::kNotFound);
}

#undef TESSERA_STORAGE_SUITE_CASE

}  // namespace storage_cases

// ---- registration --------------------------------------------------------------------------

// One case of the suite: its name, the capability it needs (null: none), how to make it.
struct StorageSuiteCase {
  const char* name;
  bool StorageCapabilities::*needs;
  StorageSuiteTest* (*make)(StorageSuiteParams params);
};

template <typename Case>
StorageSuiteTest* MakeStorageSuiteCase(StorageSuiteParams params) {
  return new Case(std::move(params));
}

// Every case, in order.
inline const std::vector<StorageSuiteCase>& StorageSuiteCases() {
#define TESSERA_STORAGE_SUITE_ENTRY(name, needs) \
  StorageSuiteCase { #name, needs, &MakeStorageSuiteCase < storage_cases::name> }
  static const std::vector<StorageSuiteCase> cases = {
      TESSERA_STORAGE_SUITE_ENTRY(WriteReadRoundTripAtOffsets,
                                  &StorageCapabilities::positional_writes),
      TESSERA_STORAGE_SUITE_ENTRY(LargeWriteAndReadCrossMaxIoBytes, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(SparseOutOfOrderWritesZeroFillGaps,
                                  &StorageCapabilities::positional_writes),
      TESSERA_STORAGE_SUITE_ENTRY(ReadPastEndIsDataLossNamingPathAndSize, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(ReaderSizeIsSizeAtOpen, &StorageCapabilities::positional_writes),
      TESSERA_STORAGE_SUITE_ENTRY(ReadOfFileTruncatedAfterOpenIsDataLoss,
                                  &StorageCapabilities::positional_writes),
      TESSERA_STORAGE_SUITE_ENTRY(MapOfFileTruncatedAfterOpenFails, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(TruncateModeTruncatesExistingFile, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(ExclusiveCreateRefusesAnExistingFile, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(ExclusiveNewNameRefusesAnExistingFileAtOpenOrClose, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(AFileOpenedWithItsPrefixReadsLikeAnyOther, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(RemoveIfPresentRemovesAFileAndToleratesAMissingOne, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(ExclusiveCreateRefusesADirectory,
                                  &StorageCapabilities::directory_sync),
      TESSERA_STORAGE_SUITE_ENTRY(MissingPathsAreNotFound, &StorageCapabilities::directory_sync),
      TESSERA_STORAGE_SUITE_ENTRY(CreateDirsIsNestedAndIdempotent,
                                  &StorageCapabilities::directory_sync),
      TESSERA_STORAGE_SUITE_ENTRY(CreateDirsThroughAFileFails,
                                  &StorageCapabilities::directory_sync),
      TESSERA_STORAGE_SUITE_ENTRY(StatReportsTheType, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(ListDirIsSortedWithoutDotEntries, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(RenameReplacesTheTarget, &StorageCapabilities::rename),
      TESSERA_STORAGE_SUITE_ENTRY(RenameMovesADirectoryWithItsContents,
                                  &StorageCapabilities::rename),
      TESSERA_STORAGE_SUITE_ENTRY(RemoveDeletesAFileButNotADirectory, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(RemoveDirRemovesOnlyAnEmptyDirectory,
                                  &StorageCapabilities::directory_sync),
      TESSERA_STORAGE_SUITE_ENTRY(DuplicateSlashesAndDotsNameTheSameFile, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(OpenWritableFileFollowsItsInodeAcrossRename,
                                  &StorageCapabilities::rename),
      TESSERA_STORAGE_SUITE_ENTRY(OpenFilesKeepWorkingAfterRemove,
                                  &StorageCapabilities::positional_writes),
      TESSERA_STORAGE_SUITE_ENTRY(CloseIsIdempotentAndLaterWritesFail, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(SyncDirOfAFileFails, &StorageCapabilities::directory_sync),
      TESSERA_STORAGE_SUITE_ENTRY(ConcurrentWriteAtOfDisjointRanges,
                                  &StorageCapabilities::positional_writes),
      TESSERA_STORAGE_SUITE_ENTRY(ConcurrentFileCreationInOneDirectory,
                                  &StorageCapabilities::rename),
      TESSERA_STORAGE_SUITE_ENTRY(StartWritebackKeepsTheBytes, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(CopyFromCopiesTheRangeAndRefusesPastTheEnd, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(MapShowsTheBytesOfReadAtOrIsUnimplemented, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(CapabilitiesAreTheOnesDeclared, nullptr),
      TESSERA_STORAGE_SUITE_ENTRY(CreateOnlyCreatesOnceAndRefusesAnExistingName,
                                  &StorageCapabilities::conditional_create),
      TESSERA_STORAGE_SUITE_ENTRY(ReplaceReplacesWholeAndCreatesWhenMissing,
                                  &StorageCapabilities::conditional_create),
      TESSERA_STORAGE_SUITE_ENTRY(PublishIsNotBlockedByTheTemporaryOfAKilledAttempt,
                                  &StorageCapabilities::rename),
      TESSERA_STORAGE_SUITE_ENTRY(CreateOnlyRacingCreatorsExactlyOneWins,
                                  &StorageCapabilities::conditional_create),
      TESSERA_STORAGE_SUITE_ENTRY(RenameNoReplaceMovesOnlyOntoAFreeName,
                                  &StorageCapabilities::rename),
  };
#undef TESSERA_STORAGE_SUITE_ENTRY
  return cases;
}

// The test suite a case is registered in: what it needs, as a name.
inline const char* StorageSuiteGroup(bool StorageCapabilities::*needs) {
  if (needs == &StorageCapabilities::positional_writes) return "PositionalWritesStorageTest";
  if (needs == &StorageCapabilities::rename) return "RenameStorageTest";
  if (needs == &StorageCapabilities::directory_sync) return "DirectoryStorageTest";
  if (needs == &StorageCapabilities::conditional_create) return "PublishStorageTest";
  return "StorageTest";
}

// Registers every case that `capabilities` select, as <name>/<group>.<case>. Call before
// RUN_ALL_TESTS (TESSERA_INSTANTIATE_STORAGE_SUITE does, at static initialisation). Returns
// the number of cases registered.
inline int RegisterStorageSuite(const std::string& name, StorageSuiteFactory factory,
                                StorageCapabilities capabilities, const char* file, int line) {
  int registered = 0;
  for (const StorageSuiteCase& c : StorageSuiteCases()) {
    if (c.needs != nullptr && !(capabilities.*c.needs)) continue;
    const std::string suite = name + "/" + StorageSuiteGroup(c.needs);
    const StorageSuiteParams params{name, factory, capabilities};
    ::testing::RegisterTest(suite.c_str(), c.name, nullptr, nullptr, file, line,
                            [params, make = c.make]() { return make(params); });
    ++registered;
  }
  return registered;
}

}  // namespace tessera::testing

// Runs the suite on a store: `name` (an identifier) names the instantiation, `factory` (a
// callable returning Result<std::unique_ptr<tessera::testing::StorageSuiteEnv>>) makes a fresh
// environment per case, and `capabilities` (a tessera::StorageCapabilities, in parentheses if
// it is a braced initializer) are those the store claims. At namespace scope, once per name.
#define TESSERA_INSTANTIATE_STORAGE_SUITE(name, factory, capabilities) \
  [[maybe_unused]] static const int tessera_storage_suite_##name =     \
      ::tessera::testing::RegisterStorageSuite(#name, factory, capabilities, __FILE__, __LINE__)

#endif  // TESSERA_TESTING_STORAGE_SUITE_H_
