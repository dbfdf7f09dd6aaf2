// The Storage conformance suite (tessera/testing/storage_suite.h) on the local stores (posix,
// memory, fault-injecting with no fault planned; S3 instantiates it in s3/s3_storage_test.cc),
// then what is particular to each: POSIX's files, MemoryStorage's crash model and
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

#include "tessera/fault_injecting_storage.h"
#include "tessera/memory_storage.h"
#include "tessera/status.h"
#include "tessera/storage.h"
#include "tessera/storage_wrapper.h"
#include "tessera/testing/gtest_status.h"
#include "tessera/testing/storage_suite.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

using testing::AsBytes;
using testing::kStorageSuiteMaxIoBytes;
using testing::Pattern;
using testing::ReadFile;
using testing::StorageSuiteEnv;
using testing::Temporaries;
using testing::WriteFile;

std::vector<uint8_t> Bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// ---- the conformance suite (tessera/testing/storage_suite.h) on every local store --------------

// A fresh directory under /tmp on a POSIX store whose reads and writes are split at the suite's
// odd size; removed with its contents afterwards.
class PosixEnv : public StorageSuiteEnv {
 public:
  PosixEnv() {
    char tmpl[] = "/tmp/tessera_storage_test_XXXXXX";
    const char* dir = ::mkdtemp(tmpl);
    if (dir == nullptr) ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
    root_ = dir ? dir : "/nonexistent";
    storage_ = NewPosixStorage(PosixStorageOptions{.max_io_bytes = kStorageSuiteMaxIoBytes});
  }
  ~PosixEnv() override {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
    EXPECT_FALSE(ec) << "removing " << root_ << ": " << ec.message();
  }
  Storage& storage() override { return *storage_; }
  const std::string& root() const override { return root_; }

 private:
  std::string root_;
  std::shared_ptr<Storage> storage_;
};

class MemoryEnv : public StorageSuiteEnv {
 public:
  MemoryEnv() { EXPECT_TRUE(storage_.CreateDirs(root_).ok()); }
  Storage& storage() override { return storage_; }
  const std::string& root() const override { return root_; }

 private:
  std::string root_ = "/mem/test";
  MemoryStorage storage_;
};

// With no fault planned: every operation goes through, counted, and none fails.
class FaultInjectingEnv : public StorageSuiteEnv {
 public:
  FaultInjectingEnv() : memory_(std::make_shared<MemoryStorage>()), storage_(memory_, FaultPlan{}) {
    EXPECT_TRUE(storage_.CreateDirs(root_).ok());
  }
  ~FaultInjectingEnv() override {
    EXPECT_FALSE(storage_.fault_fired());
    EXPECT_GT(storage_.operation_count(), 0);
  }
  Storage& storage() override { return storage_; }
  const std::string& root() const override { return root_; }

 private:
  std::string root_ = "/fault/test";
  std::shared_ptr<MemoryStorage> memory_;
  FaultInjectingStorage storage_;
};

// Every local store has every capability. (S3's instantiation: s3/s3_storage_test.cc.)
constexpr StorageCapabilities kPosixLike{
    .rename = true, .positional_writes = true, .directory_sync = true, .conditional_create = true};

template <typename Env>
Result<std::unique_ptr<StorageSuiteEnv>> Make() {
  return std::unique_ptr<StorageSuiteEnv>(new Env());
}

TESSERA_INSTANTIATE_STORAGE_SUITE(Posix, Make<PosixEnv>, kPosixLike);
TESSERA_INSTANTIATE_STORAGE_SUITE(Memory, Make<MemoryEnv>, kPosixLike);
TESSERA_INSTANTIATE_STORAGE_SUITE(FaultInjecting, Make<FaultInjectingEnv>, kPosixLike);

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
  TESSERA_ASSIGN_OR_FAIL(auto w, env.storage().NewWritableFile(path));
  int fd = FindFd(path);
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC) << "writable file not O_CLOEXEC";
  TESSERA_ASSERT_OK(w->Close());

  TESSERA_ASSIGN_OR_FAIL(auto r, env.storage().NewReadableFile(path));
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
  TESSERA_ASSERT_OK(WriteFile(env.storage(), file, "x"));
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
  TESSERA_ASSERT_OK(WriteFile(env.storage(), path, "bytes on disk"));
  std::ifstream in(path, std::ios::binary);
  std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, "bytes on disk");
}

TEST(PosixStorageTest, MapIsOnByDefaultAndCanBeTurnedOff) {
  PosixEnv env;
  const std::string path = JoinPath(env.root(), "f");
  TESSERA_ASSERT_OK(WriteFile(env.storage(), path, "mapped bytes"));
  {
    TESSERA_ASSIGN_OR_FAIL(auto r, NewPosixStorage()->NewReadableFile(path));
    TESSERA_ASSIGN_OR_FAIL(FileMapping m, r->Map(7, 5));
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.bytes().data()), 5), "bytes");
  }
  TESSERA_ASSIGN_OR_FAIL(auto r, NewPosixStorage({.map_reads = false})->NewReadableFile(path));
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
  TESSERA_ASSERT_OK(WriteFile(outside.storage(), target, "not yours"));
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
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(outside.storage(), target));
  EXPECT_EQ(got, "not yours");
  TESSERA_ASSIGN_OR_FAIL(FileType type, outside.storage().Stat(missing_target));
  EXPECT_EQ(type, FileType::kNotFound);
}

TEST(PosixStorageTest, StartWritebackOfAClosedFileFails) {
  PosixEnv env;
  const std::string path = JoinPath(env.root(), "f");
  TESSERA_ASSIGN_OR_FAIL(auto w, env.storage().NewWritableFile(path));
  TESSERA_ASSERT_OK(w->WriteAt(0, "x", 1));
  TESSERA_ASSERT_OK(w->Close());
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
  TESSERA_ASSERT_OK(m.CreateDirs("d/e/"));
  TESSERA_ASSERT_OK(WriteFile(m, "/d//e/x", "1"));
  for (const char* alias : {"d/e/x", "/d/e/x", "d/./e/x", "d/e/../e/x", "d/e/x/"}) {
    TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(m, alias));
    EXPECT_EQ(got, "1") << alias;
  }
  TESSERA_ASSIGN_OR_FAIL(auto names, m.ListDir("/"));
  EXPECT_THAT(names, ElementsAre("d"));
}

TEST(MemoryStorageTest, DirectoriesExistImplicitlyForSetFiles) {
  MemoryStorage m;
  m.SetFileContents("a/b/f", Bytes("x"));
  TESSERA_ASSIGN_OR_FAIL(FileType type, m.Stat("a/b"));
  EXPECT_EQ(type, FileType::kDirectory);
  TESSERA_ASSIGN_OR_FAIL(auto names, m.ListDir("a"));
  EXPECT_THAT(names, ElementsAre("b"));
}

TEST(MemoryStorageTest, GetAndSetFileContents) {
  MemoryStorage m;
  EXPECT_EQ(m.GetFileContents("nope").status().code(), StatusCode::kNotFound);
  m.SetFileContents("d/f", Bytes("abc"));
  TESSERA_ASSIGN_OR_FAIL(auto got, m.GetFileContents("d/f"));
  EXPECT_EQ(got, Bytes("abc"));
  // Set contents are durable: entry and bytes.
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(auto after, m.GetFileContents("d/f"));
  EXPECT_EQ(after, Bytes("abc"));
}

TEST(MemoryStorageTest, UnsyncedBytesAreLostInCrash) {
  MemoryStorage m;
  TESSERA_ASSERT_OK(m.CreateDirs("d"));
  TESSERA_ASSERT_OK(m.SyncDir("/"));
  TESSERA_ASSIGN_OR_FAIL(auto w, m.NewWritableFile("d/f"));
  TESSERA_ASSERT_OK(m.SyncDir("d"));
  TESSERA_ASSERT_OK(w->WriteAt(0, "abc", 3));
  TESSERA_ASSERT_OK(w->Sync());
  TESSERA_ASSERT_OK(w->WriteAt(3, "def", 3));
  TESSERA_ASSERT_OK(w->WriteAt(0, "X", 1));
  TESSERA_ASSIGN_OR_FAIL(auto before, m.GetFileContents("d/f"));
  EXPECT_EQ(before, Bytes("Xbcdef"));
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(auto after, m.GetFileContents("d/f"));
  EXPECT_EQ(after, Bytes("abc"));
}

TEST(MemoryStorageTest, UnsyncedNewEntryIsLostInCrash) {
  MemoryStorage m;
  TESSERA_ASSERT_OK(m.CreateDirs("d"));
  TESSERA_ASSERT_OK(m.SyncDir("/"));
  TESSERA_ASSERT_OK(WriteFile(m, "d/f", "synced bytes"));  // file synced, dir not
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(FileType type, m.Stat("d/f"));
  EXPECT_EQ(type, FileType::kNotFound);
  TESSERA_ASSIGN_OR_FAIL(auto names, m.ListDir("d"));
  EXPECT_THAT(names, IsEmpty());
}

TEST(MemoryStorageTest, UnsyncedDirectoryIsLostInCrash) {
  MemoryStorage m;
  TESSERA_ASSERT_OK(m.CreateDirs("a/b"));
  TESSERA_ASSERT_OK(m.SyncDir("a"));  // b is durable in a, but a is not durable in /
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(FileType type, m.Stat("a"));
  EXPECT_EQ(type, FileType::kNotFound);
}

TEST(MemoryStorageTest, RenameIsNotDurableUntilSyncDir) {
  MemoryStorage m;
  m.SetFileContents("ckpt/manifest", Bytes("old"));
  TESSERA_ASSERT_OK(WriteFile(m, "ckpt/manifest.tmp", "new"));
  TESSERA_ASSERT_OK(m.SyncDir("ckpt"));
  TESSERA_ASSERT_OK(m.Rename("ckpt/manifest.tmp", "ckpt/manifest"));
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(auto old_contents, m.GetFileContents("ckpt/manifest"));
  EXPECT_EQ(old_contents, Bytes("old"));
  TESSERA_ASSIGN_OR_FAIL(auto tmp_contents, m.GetFileContents("ckpt/manifest.tmp"));
  EXPECT_EQ(tmp_contents, Bytes("new"));

  TESSERA_ASSERT_OK(m.Rename("ckpt/manifest.tmp", "ckpt/manifest"));
  TESSERA_ASSERT_OK(m.SyncDir("ckpt"));
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(auto new_contents, m.GetFileContents("ckpt/manifest"));
  EXPECT_EQ(new_contents, Bytes("new"));
  TESSERA_ASSIGN_OR_FAIL(auto names, m.ListDir("ckpt"));
  EXPECT_THAT(names, ElementsAre("manifest"));
}

TEST(MemoryStorageTest, RemoveIsNotDurableUntilSyncDir) {
  MemoryStorage m;
  m.SetFileContents("d/f", Bytes("keep"));
  TESSERA_ASSERT_OK(m.Remove("d/f"));
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(auto back, m.GetFileContents("d/f"));
  EXPECT_EQ(back, Bytes("keep"));
  TESSERA_ASSERT_OK(m.Remove("d/f"));
  TESSERA_ASSERT_OK(m.SyncDir("d"));
  m.SimulateCrash();
  EXPECT_EQ(m.GetFileContents("d/f").status().code(), StatusCode::kNotFound);
}

TEST(MemoryStorageTest, TruncationIsNotDurableUntilSync) {
  MemoryStorage m;
  m.SetFileContents("f", Bytes("durable"));
  TESSERA_ASSIGN_OR_FAIL(auto w, m.NewWritableFile("f", CreateMode::kTruncate));
  TESSERA_ASSERT_OK(w->WriteAt(0, "v2", 2));
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(auto got, m.GetFileContents("f"));
  EXPECT_EQ(got, Bytes("durable"));
}

TEST(MemoryStorageTest, SyncedDataInSyncedDirectoriesSurvivesCrash) {
  MemoryStorage m;
  TESSERA_ASSERT_OK(m.CreateDirs("a/b"));
  TESSERA_ASSERT_OK(WriteFile(m, "a/b/f", "payload"));  // writes and syncs the bytes
  TESSERA_ASSERT_OK(m.SyncDir("a/b"));
  TESSERA_ASSERT_OK(m.SyncDir("a"));
  TESSERA_ASSERT_OK(m.SyncDir(""));
  m.SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(m, "a/b/f"));
  EXPECT_EQ(got, "payload");
}

TEST(MemoryStorageTest, FilesOpenedBeforeCrashStopWorking) {
  MemoryStorage m;
  m.SetFileContents("f", Bytes("abc"));
  TESSERA_ASSIGN_OR_FAIL(auto w, m.NewWritableFile("g"));
  TESSERA_ASSIGN_OR_FAIL(auto r, m.NewReadableFile("f"));
  m.SimulateCrash();
  EXPECT_FALSE(w->WriteAt(0, "x", 1).ok());
  EXPECT_FALSE(w->Sync().ok());
  char c;
  EXPECT_FALSE(r->ReadAt(0, &c, 1).ok());
  TESSERA_EXPECT_OK(w->Close());
}

TEST(MemoryStorageTest, RenameOfDirectoryIntoItselfFails) {
  MemoryStorage m;
  TESSERA_ASSERT_OK(m.CreateDirs("a/b"));
  EXPECT_EQ(m.Rename("a", "a/b/c").code(), StatusCode::kIOError);
  TESSERA_ASSIGN_OR_FAIL(FileType type, m.Stat("a/b"));
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
  for (const Step& step : steps) TESSERA_EXPECT_OK(step.status);
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
  for (const Step& step : RunScenario(f)) TESSERA_EXPECT_OK(step.status);
  EXPECT_FALSE(f.fault_fired());
}

TEST(FaultInjectingStorageTest, InjectedFaultDoesNotReachTheBase) {
  auto memory = std::make_shared<MemoryStorage>();
  FaultInjectingStorage f(memory, Plan(2));  // the WriteAt
  TESSERA_ASSERT_OK(f.CreateDirs("d"));
  TESSERA_ASSIGN_OR_FAIL(auto w, f.NewWritableFile("d/f"));
  EXPECT_TRUE(IsInjected(w->WriteAt(0, "data", 4)));
  TESSERA_ASSIGN_OR_FAIL(auto contents, memory->GetFileContents("d/f"));
  EXPECT_THAT(contents, IsEmpty());
  // The next operation works again.
  TESSERA_ASSERT_OK(w->WriteAt(0, "data", 4));
  TESSERA_ASSIGN_OR_FAIL(contents, memory->GetFileContents("d/f"));
  EXPECT_EQ(contents, Bytes("data"));
}

// CopyFrom is one operation, whatever its length; an injected fault copies nothing. Over a
// POSIX base the copy reaches the base with the unwrapped source (copy_file_range).
TEST(FaultInjectingStorageTest, CopyFromIsOneOperationThatCanFail) {
  auto memory = std::make_shared<MemoryStorage>();
  const std::vector<uint8_t> data = Pattern(3 << 20, 3);
  memory->SetFileContents("d/src", data);
  FaultInjectingStorage f(memory, Plan(3));                    // the second CopyFrom
  TESSERA_ASSIGN_OR_FAIL(auto r, f.NewReadableFile("d/src"));  // 0
  TESSERA_ASSIGN_OR_FAIL(auto w, f.NewWritableFile("d/dst"));  // 1
  TESSERA_ASSERT_OK(w->CopyFrom(*r, 0, 0, data.size()));       // 2
  const Status failed = w->CopyFrom(*r, 0, data.size(), 100);  // 3
  EXPECT_TRUE(IsInjected(failed)) << failed.ToString();
  EXPECT_EQ(failed.message(), "injected fault at operation 3 (CopyFrom d/dst)");
  EXPECT_EQ(f.operation_count(), 4);
  TESSERA_ASSIGN_OR_FAIL(auto contents, memory->GetFileContents("d/dst"));
  EXPECT_TRUE(contents == data);

  char tmpl[] = "/tmp/tessera_copy_test_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  FaultInjectingStorage posix(NewPosixStorage());
  TESSERA_ASSERT_OK(WriteFile(posix, dir + "/src", std::string(data.begin(), data.end())));
  TESSERA_ASSIGN_OR_FAIL(auto pr, posix.NewReadableFile(dir + "/src"));
  TESSERA_ASSIGN_OR_FAIL(auto pw, posix.NewWritableFile(dir + "/dst"));
  TESSERA_ASSERT_OK(pw->CopyFrom(*pr, 10, 0, data.size() - 10));
  TESSERA_ASSERT_OK(pw->Close());
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(posix, dir + "/dst"));
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
  TESSERA_ASSIGN_OR_FAIL(auto r, memory.NewReadableFile("/m/src"));
  TESSERA_ASSIGN_OR_FAIL(auto w, posix->NewWritableFile(dir + "/dst"));
  TESSERA_ASSERT_OK(w->CopyFrom(*r, 0, 0, data.size()));
  TESSERA_ASSERT_OK(w->Close());
  TESSERA_ASSIGN_OR_FAIL(std::string got, ReadFile(*posix, dir + "/dst"));
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
      TESSERA_EXPECT_OK(steps[i].status);
    } else {
      EXPECT_TRUE(IsInjected(steps[i].status)) << i << ": " << steps[i].status.ToString();
      EXPECT_THAT(steps[i].status.message(), HasSubstr(steps[i].op + " " + steps[i].path));
    }
  }
  EXPECT_EQ(steps[4].status.message(), "injected fault at operation 4 (Close d/f)");
  EXPECT_THAT(steps[5].status.message(), HasSubstr("operation 4"));
  EXPECT_EQ(f.operation_count(), 11);
  // Nothing after the crash reached the base: the rename and remove did not happen.
  TESSERA_ASSIGN_OR_FAIL(auto contents, memory->GetFileContents("d/f"));
  EXPECT_EQ(contents, Bytes("data"));
  // The directory entry was never synced, so a real crash loses the file.
  memory->SimulateCrash();
  TESSERA_ASSIGN_OR_FAIL(FileType type, memory->Stat("d/f"));
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
  TESSERA_EXPECT_OK(f.CreateDirs("d"));
  TESSERA_EXPECT_OK(f.Stat("d"));
  EXPECT_EQ(f.operation_count(), 2);
  f.SetPlan(Plan(1));
  TESSERA_EXPECT_OK(f.Stat("d"));
  EXPECT_TRUE(IsInjected(f.Stat("d").status()));
  TESSERA_EXPECT_OK(f.Stat("d"));
}

TEST(FaultInjectingStorageTest, CheckCountsLikeAnyOperation) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(1));
  TESSERA_EXPECT_OK(f.Check("Custom", "p"));
  const Status s = f.Check("Custom", "p");
  EXPECT_EQ(s.message(), "injected fault at operation 1 (Custom p)");
  EXPECT_EQ(f.operation_count(), 2);
}

TEST(FaultInjectingStorageTest, PathFilterCountsOnlyMatchingOperations) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(1, false, "manifest"));
  TESSERA_ASSERT_OK(f.CreateDirs("ckpt"));
  TESSERA_ASSERT_OK(WriteFile(f, "ckpt/data_0", "d"));  // 4 operations, none counted
  EXPECT_EQ(f.operation_count(), 0);
  TESSERA_ASSIGN_OR_FAIL(auto w, f.NewWritableFile("ckpt/manifest.tmp"));  // operation 0
  TESSERA_ASSERT_OK(WriteFile(f, "ckpt/data_1", "d"));
  const Status s = w->WriteAt(0, "m", 1);  // operation 1
  EXPECT_EQ(s.message(), "injected fault at operation 1 (WriteAt ckpt/manifest.tmp)");
  TESSERA_EXPECT_OK(w->WriteAt(0, "m", 1));
  // Rename counts when either end matches.
  TESSERA_EXPECT_OK(f.Rename("ckpt/manifest.tmp", "ckpt/manifest"));
  EXPECT_EQ(f.operation_count(), 4);
}

TEST(FaultInjectingStorageTest, CrashWithPathFilterStopsEverything) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(0, true, "manifest"));
  TESSERA_ASSERT_OK(f.CreateDirs("ckpt"));
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
    TESSERA_ASSIGN_OR_FAIL(w, f.NewWritableFile("f"));
    TESSERA_ASSERT_OK(w->WriteAt(0, "a", 1));
  }
  EXPECT_TRUE(IsInjected(w->Sync()));
  TESSERA_EXPECT_OK(w->Close());
}

TEST(FaultInjectingStorageTest, ConcurrentOperationsAreNumberedOnce) {
  FaultInjectingStorage f(std::make_shared<MemoryStorage>(), Plan(500));
  TESSERA_ASSERT_OK(f.CreateDirs("d"));
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

// A synced Publish is the temporary file's creation, write, sync and close, the rename and the
// directory's sync; unsynced, the creation, write, close and rename.
TEST(FaultInjectingStorageTest, PublishIsMadeOfCountedSteps) {
  auto memory = std::make_shared<MemoryStorage>();
  ASSERT_TRUE(memory->CreateDirs("/d").ok());
  FaultInjectingStorage f(memory);
  TESSERA_ASSERT_OK(f.Publish("/d/x", AsBytes("bytes"), PublishMode::kCreateOnly, true));
  EXPECT_EQ(f.operation_count(), 6);
  f.SetPlan(FaultPlan{});
  TESSERA_ASSERT_OK(f.Publish("/d/x", AsBytes("more"), PublishMode::kReplace, false));
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
  const Status failed = f.Publish("/d/x", AsBytes("bytes"), PublishMode::kCreateOnly, true);
  EXPECT_TRUE(IsInjected(failed)) << failed.ToString();
  EXPECT_THAT(failed.message(), HasSubstr("Publish /d/x"));
  EXPECT_EQ(store->publishes, 0);
  f.SetPlan(FaultPlan{});
  TESSERA_ASSERT_OK(f.Publish("/d/x", AsBytes("bytes"), PublishMode::kCreateOnly, true));
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
      const Status published = f.Publish("/d/x", AsBytes("the new bytes"), mode, true);
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
  ASSERT_TRUE(memory.Publish("/d/x", AsBytes("new"), PublishMode::kReplace, false).ok());
  ASSERT_TRUE(memory.Publish("/d/y", AsBytes("y"), PublishMode::kCreateOnly, false).ok());
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
    (void)killing.Publish(dir + "/x", AsBytes("killed"), PublishMode::kCreateOnly, true);
    ::_exit(3);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);
  std::shared_ptr<Storage> posix = NewPosixStorage();
  std::vector<std::string> left = Temporaries(*posix, dir);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(posix->Stat(dir + "/x").value(), FileType::kNotFound);
  TESSERA_ASSERT_OK(posix->Publish(dir + "/x", AsBytes("retried"), PublishMode::kCreateOnly, true));
  EXPECT_EQ(ReadFile(*posix, dir + "/x").value(), "retried");
  std::filesystem::remove_all(dir);
}

TEST(PosixStorageTest, RenameNoReplaceRefusesADanglingSymbolicLink) {
  char tmpl[] = "/tmp/tessera_noreplace_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::shared_ptr<Storage> posix = NewPosixStorage();
  ASSERT_EQ(::symlink((dir + "/nowhere").c_str(), (dir + "/link").c_str()), 0);
  TESSERA_ASSERT_OK(WriteFile(*posix, dir + "/a", "A"));
  EXPECT_EQ(posix->RenameNoReplace(dir + "/a", dir + "/link").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(posix->Publish(dir + "/link", AsBytes("x"), PublishMode::kCreateOnly, true).code(),
            StatusCode::kAlreadyExists);
  EXPECT_FALSE(std::filesystem::exists(dir + "/nowhere"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera
