// Issue 11 (reliability), items 5-10: what a careful adversarial user found, each with the
// test that failed before its fix. docs/RELIABILITY.md lists these tests by promise.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "format/tessera/manifest.h"
#include "tessera/checkpoint.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "tessera/storage_wrapper.h"
#include "testing/commits.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

// A small state: one tensor of `value`s and one object.
struct SmallState {
  explicit SmallState(float value) : values(256, value) {
    EXPECT_OK(dict.Add(ShardedTensor::Whole(
        "w", TensorView(values.data(), DType::kF32, {static_cast<int64_t>(values.size())}))));
    EXPECT_OK(dict.Add(ShardedObject{"step", {1, 2, 3}, {}}));
  }
  std::vector<float> values;
  StateDict dict;
};

// The value the tensor "w" of the checkpoint at `path` holds (all elements equal), or NaN.
float LoadedValue(const std::string& path) {
  std::vector<float> values(256, -1);
  StateDict dict;
  EXPECT_OK(dict.Add(ShardedTensor::Whole(
      "w", TensorView(values.data(), DType::kF32, {static_cast<int64_t>(values.size())}))));
  EXPECT_OK(dict.Add(ShardedObject{"step", {}, {}}));
  Result<LoadReport> loaded = Load(dict, path);
  EXPECT_OK(loaded);
  return loaded.ok() ? values[0] : std::nanf("");
}

// ---- item 5: a planted symbolic link never redirects a write --------------------------------

// Before: with the plan cache, the next save id was a fixed function of the previous one (this
// one), so an attacker who could read the directory knew the next save's file names.
std::string OldNextSaveId(const std::string& previous) {
  uint64_t x = std::strtoull(previous.c_str(), nullptr, 16) + 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  char id[17];
  std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(x));
  return id;
}

TEST(PlantedSymlinkTest, CachedSaveIdsCannotBePredictedFromTheDirectory) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  const std::string victim = dir.Sub("victim");
  WriteAll(victim, "not yours");
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  SmallState first(1), second(2);
  ASSERT_OK_AND_ASSIGN(SaveReport saved, Save(first.dict, path, *comm));
  // Links at every name the old derivation would have used next.
  const std::string guess = OldNextSaveId(saved.save_id);
  for (const std::string& name : {DataFileName(guess, 0, 0), DataFileName(guess, 0, 1)}) {
    ASSERT_EQ(::symlink(victim.c_str(), (path + "/" + name).c_str()), 0) << std::strerror(errno);
  }
  ASSERT_OK_AND_ASSIGN(SaveReport again, Save(second.dict, path, *comm));
  EXPECT_TRUE(again.plan_cache_hit);
  EXPECT_NE(again.save_id, guess);
  EXPECT_EQ(ReadAll(victim), "not yours");
  EXPECT_EQ(LoadedValue(path), 2);
}

// Plants a symbolic link to `target` under the name of the first file a save creates whose
// name satisfies `pick`, just before the save creates it (the worst case: the attacker knew
// the name).
class PlantingStorage : public StorageWrapper {
 public:
  PlantingStorage(std::string target, std::function<bool(const std::string&)> pick)
      : StorageWrapper(NewPosixStorage()), target_(std::move(target)), pick_(std::move(pick)) {}
  // Through this storage's own calls, so that the commit's temporary file is seen too.
  Status Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                 bool sync) override {
    return PublishThroughRename(path, bytes, mode, sync);
  }
  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override {
    const std::string name = std::filesystem::path(path).filename();
    if (!planted_.empty() || !pick_(name)) return target().NewWritableFile(path, mode);
    planted_ = path;
    if (::symlink(target_.c_str(), path.c_str()) != 0) return IOErrorFromErrno("symlink", errno);
    return target().NewWritableFile(path, mode);
  }

  const std::string& planted() const { return planted_; }

 private:
  std::string target_;
  std::function<bool(const std::string&)> pick_;
  std::string planted_;
};

bool IsCommitTemporary(const std::string& name) {
  std::string target;
  uint64_t seq = 0;
  return ParsePublishTemporaryName(name, &target) && ParseCommitName(target, &seq);
}

TEST(PlantedSymlinkTest, ALinkAtTheNameOfADataFileIsRefusedNeverFollowed) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  const std::string victim = dir.Sub("victim");
  WriteAll(victim, "not yours");
  SmallState first(1), second(2);
  ASSERT_OK(Save(first.dict, path));
  auto planting = std::make_shared<PlantingStorage>(victim, IsTesseraDataFileName);
  SaveOptions options;
  options.storage = planting;
  Result<SaveReport> saved = Save(second.dict, path, options);
  ASSERT_FALSE(planting->planted().empty());
  ASSERT_FALSE(saved.ok());
  EXPECT_EQ(saved.status().code(), StatusCode::kAlreadyExists) << saved.status().ToString();
  EXPECT_THAT(saved.status().message(), HasSubstr(planting->planted()));
  EXPECT_EQ(ReadAll(victim), "not yours");
  EXPECT_EQ(LoadedValue(path), 1);  // the previous checkpoint is intact
}

// The commit's temporary name is drawn again when taken; the commit's own name is published
// create-only without following anything (a link there is an existing name: the commit takes
// the next number). Neither redirects a write.
TEST(PlantedSymlinkTest, ALinkAtTheCommitsTemporaryOrNextNameIsNeverFollowed) {
  for (bool at_the_commit : {false, true}) {
    SCOPED_TRACE(at_the_commit ? "the next commit's name" : "the commit's temporary name");
    TempDir dir;
    const std::string path = dir.Sub("ck");
    const std::string victim = dir.Sub("victim");
    WriteAll(victim, "not yours");
    SmallState first(1), second(2);
    ASSERT_OK(Save(first.dict, path));
    auto planting = std::make_shared<PlantingStorage>(victim, IsCommitTemporary);
    SaveOptions options;
    options.storage = planting;
    if (at_the_commit) {
      ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path));
      const std::string next = path + "/" + NumberedManifestName(m.commit_seq + 1);
      ASSERT_EQ(::symlink(victim.c_str(), next.c_str()), 0) << std::strerror(errno);
      options.storage = nullptr;
    }
    ASSERT_OK(Save(second.dict, path, options));
    if (!at_the_commit) {
      ASSERT_FALSE(planting->planted().empty());
    }
    EXPECT_EQ(ReadAll(victim), "not yours");
    EXPECT_EQ(LoadedValue(path), 2);
  }
}

// ---- item 6: keys and user metadata are UTF-8 ------------------------------------------------

// Before: the C++ API accepted any bytes as user metadata; `tessera inspect --json` then aborted
// and Python raised UnicodeDecodeError on the checkpoint.
TEST(Utf8Test, SaveRefusesUserMetadataThatIsNotUtf8NamingTheKey) {
  auto storage = std::make_shared<MemoryStorage>();
  SmallState state(1);
  SaveOptions options;
  options.storage = storage;
  options.user_metadata = {{"ok", "caf\xc3\xa9"}, {"bad\xff", "v"}};
  Result<SaveReport> saved = Save(state.dict, "/ck", options);
  EXPECT_EQ(saved.status().code(), StatusCode::kInvalidArgument) << saved.status().ToString();
  EXPECT_THAT(saved.status().message(), HasSubstr("user_metadata key \"bad\\xff\" is not valid"));
  options.user_metadata = {{"key", "\xc0\xaf"}};  // an overlong '/'
  saved = Save(state.dict, "/ck", options);
  EXPECT_EQ(saved.status().code(), StatusCode::kInvalidArgument) << saved.status().ToString();
  EXPECT_THAT(saved.status().message(), HasSubstr("user_metadata[\"key\"] = \"\\xc0\\xaf\""));
  EXPECT_FALSE(testing::HasCommit(*storage, "/ck"));
  // With several ranks, rank 0's metadata is checked and every rank returns its error.
  std::vector<Status> statuses = RunLocalRanks(3, [&](Comm& comm) -> Status {
    SmallState mine(1);
    StateDict empty;
    SaveOptions o;
    o.storage = storage;
    if (comm.rank() == 0) o.user_metadata = {{"bad\xff", "v"}};
    return Save(comm.rank() == 0 ? mine.dict : empty, "/ck", comm, o).status();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("bad\\xff"));
  }
  options.user_metadata = {{"ok", "caf\xc3\xa9"}};
  EXPECT_OK(Save(state.dict, "/ck", options));
}

// ---- item 10: collective deadlines ------------------------------------------------------------

// Before: a rank that stopped calling collectives in a save was reported by one peer as
// "timed out ... waiting for rank 0" (its parent in a tree), the others as kAborted.
TEST(DeadlineTest, ASaveWithARankThatStopsFailsEverywhereNamingIt) {
  auto storage = std::make_shared<MemoryStorage>();
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> statuses = RunLocalRanks(
      4,
      [&](Comm& comm) -> Status {
        if (comm.rank() == 3) std::this_thread::sleep_for(std::chrono::milliseconds(600));
        SmallState state(static_cast<float>(comm.rank()));
        StateDict mine;
        SaveOptions options;
        options.storage = storage;
        return Save(comm.rank() == 0 ? state.dict : mine, "/ck", comm, options).status();
      },
      LocalCommOptions{.timeout = std::chrono::milliseconds(200)});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kDeadlineExceeded) << statuses[r].ToString();
    EXPECT_THAT(statuses[r].message(), HasSubstr("gave up after waiting 200 ms for rank 3 to "
                                                 "enter it"));
  }
  EXPECT_FALSE(testing::HasCommit(*storage, "/ck"));
}

// ---- item 7: a manifest is never read into memory on the strength of its size alone ---------

// Peak resident memory of this process so far, in bytes.
uint64_t PeakRssBytes() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

// Before: ReadManifestBytes allocated the file's size (std::bad_alloc for 64 GiB, an abort of
// `tessera inspect` and `verify`; 3 GiB cost 3.1 GB of memory and 12 s before the rejection).
TEST(HugeManifestTest, SparseManifestsAreRejectedWithoutReadingThem) {
  TempDir dir;
  const std::string path = dir.Sub("ck");
  SmallState state(1);
  ASSERT_OK(Save(state.dict, path));
  const std::string manifest = testing::CommitPath(path);
  const std::string good = ReadAll(manifest);
  const uint64_t peak_before = PeakRssBytes();
  auto expect_rejected = [&](const std::string& what) {
    const auto start = std::chrono::steady_clock::now();
    Result<Metadata> read = ReadMetadata(path);
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(read.status().code(), StatusCode::kDataLoss) << read.status().ToString();
    EXPECT_THAT(read.status().message(), HasSubstr(what));
    Result<VerifyReport> verified = Verify(path);
    ASSERT_FALSE(verified.ok());
    EXPECT_THAT(verified.status().message(), HasSubstr(what));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  };
  // 1. Grown to 64 GiB (sparse): the header still declares the small body.
  ASSERT_EQ(::truncate(manifest.c_str(), off_t{64} << 30), 0) << std::strerror(errno);
  expect_rejected("unexpected bytes after its checksum");
  // 2. The header declares 64 GiB too: over the limit.
  std::string header = good;
  const uint64_t body = (uint64_t{64} << 30) - kManifestHeaderBytes - kManifestTrailerBytes;
  std::memcpy(header.data() + 16, &body, sizeof(body));
  WriteAll(manifest, header);
  ASSERT_EQ(::truncate(manifest.c_str(), off_t{64} << 30), 0);
  expect_rejected("is larger than the 4294967296 bytes this build of tessera reads");
  // 3. Within the limit, declared and sized alike (768 MiB of zeros): the checksum is checked
  // through a small buffer before anything of that size is allocated.
  const uint64_t size = uint64_t{3} << 28;
  const uint64_t body2 = size - kManifestHeaderBytes - kManifestTrailerBytes;
  std::memcpy(header.data() + 16, &body2, sizeof(body2));
  WriteAll(manifest, header);
  ASSERT_EQ(::truncate(manifest.c_str(), static_cast<off_t>(size)), 0);
  expect_rejected("manifest checksum mismatch");
  EXPECT_LT(PeakRssBytes(), peak_before + (uint64_t{256} << 20));
  // And the real manifest still reads.
  WriteAll(manifest, good);
  EXPECT_EQ(LoadedValue(path), 1);
}

}  // namespace
}  // namespace tessera
