// The commit protocol under hostile conditions: a writer that would write what the reader
// refuses (issue 11, item 1), and two saves into one directory at once from two processes
// (item 2), interleaved deterministically through a Storage that pauses at a chosen step.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>

#include "format/tessera/manifest.h"
#include "tessera/checkpoint.h"
#include "tessera/storage_wrapper.h"
#include "testing/commits.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

// A state whose values identify it: `gen` in every element.
struct Gen {
  std::vector<float> a, b;
  explicit Gen(int gen) : a(4096, static_cast<float>(gen)), b(100, static_cast<float>(-gen)) {}
  StateDict Dict() {
    StateDict s;
    (void)s.Add(ShardedTensor::Whole("a", TensorView(a.data(), DType::kF32, {64, 64})));
    (void)s.Add(ShardedTensor::Whole("b", TensorView(b.data(), DType::kF32, {100})));
    return s;
  }
};

// Which generation the checkpoint at `path` holds; -1 when it does not load.
int Loaded(const std::string& path, Status* error = nullptr) {
  Gen g(0);
  StateDict s = g.Dict();
  Status status = Load(s, path).status();
  if (error) *error = status;
  if (!status.ok()) return -1;
  const int gen = static_cast<int>(g.a[0]);
  for (float v : g.a) {
    if (v != gen) return -2;
  }
  return gen;
}

std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// ---- item 1: never commit what the reader refuses --------------------------------------------

TEST(CommitTest, ASaveTheReaderWouldRefuseFailsAndKeepsThePreviousCheckpoint) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  Gen one(1);
  ASSERT_OK(Save(one.Dict(), path));
  const std::vector<std::string> before = Names(path);
  std::vector<uint8_t> byte(16);
  struct Bad {
    const char* what;
    ShardedTensor tensor;
  };
  const int64_t max = std::numeric_limits<int64_t>::max();
  std::vector<Bad> bad;
  {
    ShardedTensor t = ShardedTensor::Shard("huge", TensorView(byte.data(), DType::kF32, {1, 1}),
                                           {int64_t{1} << 62, 4}, {0, 0});
    t.partial = true;  // a partial tensor's byte size overflows int64
    bad.push_back({"partial [2^62, 4] F32", t});
    t.global_shape = {int64_t{1} << 32, int64_t{1} << 32};
    bad.push_back({"partial [2^32, 2^32] F32", t});
    ShardedTensor m =
        ShardedTensor::Shard("max", TensorView(byte.data(), DType::kF32, {1}), {max}, {0});
    m.partial = true;
    bad.push_back({"partial [INT64_MAX] F32", m});
    ShardedTensor o =
        ShardedTensor::Shard("off", TensorView(byte.data(), DType::kF32, {1}), {max}, {max - 1});
    o.partial = true;
    bad.push_back({"a box at offset INT64_MAX - 1", o});
  }
  for (Bad& b : bad) {
    SCOPED_TRACE(b.what);
    StateDict state = one.Dict();
    Status added = state.Add(b.tensor);
    Status saved = added.ok() ? Save(state, path).status() : added;
    EXPECT_FALSE(saved.ok());
    EXPECT_EQ(saved.code(), StatusCode::kInvalidArgument) << saved.ToString();
    EXPECT_EQ(Loaded(path), 1);
    EXPECT_EQ(Names(path), before);
  }
  // More than 64 dimensions.
  std::vector<uint8_t> one_byte(1);
  StateDict deep = one.Dict();
  Status added =
      deep.Add(ShardedTensor::Whole("deep", TensorView(one_byte.data(), DType::kU8, Shape(65, 1))));
  Status saved = added.ok() ? Save(deep, path).status() : added;
  EXPECT_EQ(saved.code(), StatusCode::kInvalidArgument) << saved.ToString();
  EXPECT_EQ(Loaded(path), 1);
  EXPECT_EQ(Names(path), before);
}

// ---- item 2: concurrent saves ----------------------------------------------------------------

// Posix storage that stops at one step of a save and waits for the other process: it writes a
// byte to `reached` and reads one from `resume`.
class PausingStorage : public StorageWrapper {
 public:
  enum class At { kNone, kBeforeCommit, kAfterCommit };
  PausingStorage(At at, int reached, int resume)
      : StorageWrapper(NewPosixStorage()), at_(at), reached_(reached), resume_(resume) {}

  Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                 bool sync) override {
    uint64_t seq = 0;
    const bool commit = ParseCommitName(std::filesystem::path(path).filename().string(), &seq);
    if (commit && at_ == At::kBeforeCommit) Pause();
    Status s = target().Publish(path, bytes, mode, sync);
    if (commit && at_ == At::kAfterCommit) Pause();
    return s;
  }

 private:
  void Pause() {
    if (std::exchange(paused_, true)) return;  // once
    if (reached_ < 0) _exit(0);                // no one to wait for: die here, as a killed job does
    char c = 1;
    EXPECT_EQ(write(reached_, &c, 1), 1);
    EXPECT_EQ(read(resume_, &c, 1), 1);
  }
  At at_;
  int reached_, resume_;
  bool paused_ = false;
};

// Save A (this process) pauses at `pause_at`; meanwhile save B (a child process) saves
// generation 2 into the same directory from start to end; then A finishes. Returns A's status;
// `b_ok` tells whether B succeeded.
Status SaveConcurrently(const std::string& path, PausingStorage::At pause_at, bool* b_ok) {
  int reached[2], resume[2];
  EXPECT_EQ(pipe(reached), 0);
  EXPECT_EQ(pipe(resume), 0);
  Gen a(3);
  SaveOptions options;
  options.storage = std::make_shared<PausingStorage>(pause_at, reached[1], resume[0]);
  Status a_status;
  std::thread a_thread([&] { a_status = Save(a.Dict(), path, options).status(); });
  char c;
  EXPECT_EQ(read(reached[0], &c, 1), 1);  // A is paused
  const pid_t child = fork();
  if (child == 0) {
    Gen b(2);
    _exit(Save(b.Dict(), path).ok() ? 0 : 1);
  }
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  *b_ok = WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0;
  EXPECT_EQ(write(resume[1], &c, 1), 1);  // let A finish
  a_thread.join();
  for (int fd : {reached[0], reached[1], resume[0], resume[1]}) close(fd);
  return a_status;
}

// B commits and cleans up while A has written its data files but not its manifest: B's cleanup
// must keep A's files (A's marker says A runs), so A commits a complete checkpoint.
TEST(ConcurrentSaveTest, ACleanupKeepsTheFilesOfASaveStillRunning) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  Gen one(1);
  ASSERT_OK(Save(one.Dict(), path));
  bool b_ok = false;
  Status a = SaveConcurrently(path, PausingStorage::At::kBeforeCommit, &b_ok);
  EXPECT_TRUE(b_ok);
  ASSERT_OK(a);
  Status error;
  EXPECT_EQ(Loaded(path, &error), 3) << error.ToString();
  EXPECT_OK(Verify(path));
  // A's cleanup removed B's files and generation 1's, and every marker.
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
  std::vector<std::string> want = testing::CommitFiles(*NewPosixStorage(), path);
  for (const FileInfo& f : m.files) want.push_back(f.name);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(Names(path), want);
}

// A has committed but not cleaned up when B saves: B's cleanup keeps A's files (A still runs),
// and A's cleanup, reading the manifest now in place, keeps B's. B's checkpoint loads.
TEST(ConcurrentSaveTest, ASaveCommittedAfterAnotherKeepsItsFiles) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  Gen one(1);
  ASSERT_OK(Save(one.Dict(), path));
  bool b_ok = false;
  Status a = SaveConcurrently(path, PausingStorage::At::kAfterCommit, &b_ok);
  EXPECT_TRUE(b_ok);
  ASSERT_OK(a);
  Status error;
  EXPECT_EQ(Loaded(path, &error), 2) << error.ToString();
  EXPECT_OK(Verify(path));
  // A later save cleans up what the two left.
  Gen four(4);
  ASSERT_OK(Save(four.Dict(), path));
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
  std::vector<std::string> want = testing::CommitFiles(*NewPosixStorage(), path);
  for (const FileInfo& f : m.files) want.push_back(f.name);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(Names(path), want);
}

// A marker whose owner died (a save killed mid-way) does not protect its files forever: the
// next save removes them and the marker.
TEST(ConcurrentSaveTest, FilesOfADeadSaveAreRemovedByTheNextSave) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  const pid_t child = fork();
  if (child == 0) {
    // Killed right after writing its data files, before any manifest.
    Gen two(2);
    SaveOptions options;
    options.storage = std::make_shared<PausingStorage>(PausingStorage::At::kBeforeCommit, -1, -1);
    (void)Save(two.Dict(), path, options);
    _exit(1);  // not reached: the storage ends the process when the save reaches the manifest
  }
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  std::vector<std::string> left = Names(path);
  ASSERT_TRUE(std::any_of(left.begin(), left.end(), [](const std::string& n) {
    return n.starts_with("tessera.saving.");
  })) << "the killed save left its marker";
  Gen one(1);
  ASSERT_OK(Save(one.Dict(), path));
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
  std::vector<std::string> want = testing::CommitFiles(*NewPosixStorage(), path);
  for (const FileInfo& f : m.files) want.push_back(f.name);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(Names(path), want);
}

}  // namespace
}  // namespace tessera
