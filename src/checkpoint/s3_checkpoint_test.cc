// Save, Load, Verify, AsyncSave, RemoveKeys, Convert and the rank-local save with Finalize on
// S3, through s3:// URIs (credentials and endpoint from the AWS environment variables, as a user
// sets them), against moto's server on loopback (src/storage/s3/testing/moto_server.h). A server
// that cannot start fails every case; none skips.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "storage/s3/s3_client.h"
#include "storage/s3/testing/moto_server.h"
#include "tessera/async_save.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/remove_keys.h"
#include "tessera/s3_storage.h"
#include "tessera/storage_uri.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// The status of a Status or a Result, printed when not OK (for messages with context).
template <typename T>
::testing::AssertionResult Ok(const T& value) {
  const Status& status = internal::GetStatus(value);
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << status.ToString();
}

constexpr int64_t kRows = 96, kCols = 40;

// Element (r, c) of the global tensor "w" (F32) and of "b" (I32, one row).
float W(int64_t r, int64_t c, float salt) { return salt + static_cast<float>(r * kCols + c); }
int32_t B(int64_t c, int32_t salt) { return salt + static_cast<int32_t>(c) * 7; }

// Sets the AWS variables for one test (as a user would) and restores them after.
class S3CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<s3::testing::MotoServer*> server = s3::testing::SharedMotoServer();
    ASSERT_TRUE(server.ok()) << "could not start the S3 test server (moto): "
                             << server.status().ToString();
    server_ = *server;
    Set("AWS_ACCESS_KEY_ID", server_->credentials().access_key_id);
    Set("AWS_SECRET_ACCESS_KEY", server_->credentials().secret_access_key);
    Set("AWS_ENDPOINT_URL", server_->endpoint());
    Set("AWS_REGION", "us-east-1");
    Set("AWS_CONFIG_FILE", "/dev/null");
    Set("AWS_SHARED_CREDENTIALS_FILE", "/dev/null");
    Unset("AWS_SESSION_TOKEN");
    Unset("AWS_PROFILE");
    Unset("AWS_ENDPOINT_URL_S3");
    base_ = "s3://" + server_->bucket() + "/" + s3::testing::UniquePrefix();
  }
  void TearDown() override {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }
  void Set(const std::string& name, const std::string& value) {
    Remember(name);
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  void Unset(const std::string& name) {
    Remember(name);
    ::unsetenv(name.c_str());
  }
  void Remember(const std::string& name) {
    if (saved_.count(name)) return;
    const char* v = ::getenv(name.c_str());
    saved_[name] = v ? std::optional<std::string>(v) : std::nullopt;
  }

  s3::testing::MotoServer* server_ = nullptr;
  std::string base_;  // s3://bucket/<a prefix of this test>
  std::map<std::string, std::optional<std::string>> saved_;
};

// One rank's part of the state: rows [r0, r1) of "w", columns [c0, c1) of "b", and an object.
struct Part {
  std::vector<float> w;
  std::vector<int32_t> b;
  StateDict dict;
};

Status BuildPart(Part& part, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float salt, bool fill,
                 bool with_object) {
  part.w.assign(static_cast<size_t>((r1 - r0) * kCols), 0.0f);
  part.b.assign(static_cast<size_t>(c1 - c0), 0);
  if (fill) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < kCols; ++c) part.w[(r - r0) * kCols + c] = W(r, c, salt);
    }
    for (int64_t c = c0; c < c1; ++c) part.b[c - c0] = B(c, static_cast<int32_t>(salt));
  }
  TESSERA_RETURN_IF_ERROR(part.dict.Add(ShardedTensor::Shard(
      "w", TensorView(part.w.data(), DType::kF32, {r1 - r0, kCols}), {kRows, kCols}, {r0, 0})));
  TESSERA_RETURN_IF_ERROR(part.dict.Add(
      ShardedTensor::Shard("b", TensorView(part.b.data(), DType::kI32, {c1 - c0}), {kCols}, {c0})));
  if (with_object) {
    TESSERA_RETURN_IF_ERROR(part.dict.Add(ShardedObject{"step", {'4', '2'}, {}}));
  }
  return Status::Ok();
}

// Saves the state (salted) with `ranks` ranks, each holding a band of rows of "w" and of "b".
// Requests of kind `op` sent between two snapshots of a client's stats.
uint64_t Sent(const s3::S3Stats& before, const s3::S3Stats& after, s3::S3Op op) {
  const size_t i = static_cast<size_t>(op);
  return after.requests[i] - before.requests[i];
}

Status SaveRanks(const std::string& uri, int ranks, float salt, SaveOptions options = {}) {
  return FirstError(RunLocalRanks(ranks, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    Part part;
    TESSERA_RETURN_IF_ERROR(BuildPart(part, kRows * r / ranks, kRows * (r + 1) / ranks,
                                      kCols * r / ranks, kCols * (r + 1) / ranks, salt, true,
                                      r == 0));
    return Save(part.dict, uri, comm, options).status();
  }));
}

// Loads with `ranks` ranks, each asking for a band of columns of "w" (another layout than the
// save's: a resharded load, ranged reads of the runs each needs) and all of "b", and checks
// every element against `salt`.
Status LoadAndCheck(const std::string& uri, int ranks, float salt, uint64_t* bytes_read = nullptr,
                    std::shared_ptr<Storage> storage = nullptr) {
  std::vector<uint64_t> read(ranks, 0);
  TESSERA_RETURN_IF_ERROR(FirstError(RunLocalRanks(ranks, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    const int64_t c0 = kCols * r / ranks, c1 = kCols * (r + 1) / ranks;
    std::vector<float> w(static_cast<size_t>(kRows * (c1 - c0)), -1.0f);
    std::vector<int32_t> b(kCols, -1);
    StateDict dict;
    TESSERA_RETURN_IF_ERROR(dict.Add(ShardedTensor::Shard(
        "w", TensorView(w.data(), DType::kF32, {kRows, c1 - c0}), {kRows, kCols}, {0, c0})));
    TESSERA_RETURN_IF_ERROR(dict.Add(
        ShardedTensor::Shard("b", TensorView(b.data(), DType::kI32, {kCols}), {kCols}, {0})));
    LoadOptions options;
    options.unexpected_keys = KeyPolicy::kSkip;
    options.storage = storage;
    TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(dict, uri, comm, options));
    read[r] = report.bytes_read;
    for (int64_t row = 0; row < kRows; ++row) {
      for (int64_t c = c0; c < c1; ++c) {
        if (w[row * (c1 - c0) + (c - c0)] != W(row, c, salt)) {
          return DataLoss("rank " + std::to_string(r) + ": w[" + std::to_string(row) + "," +
                          std::to_string(c) + "] differs");
        }
      }
    }
    for (int64_t c = 0; c < kCols; ++c) {
      if (b[c] != B(c, static_cast<int32_t>(salt))) {
        return DataLoss("b[" + std::to_string(c) + "] differs");
      }
    }
    return Status::Ok();
  })));
  if (bytes_read) {
    *bytes_read = 0;
    for (uint64_t n : read) *bytes_read += n;
  }
  return Status::Ok();
}

// Loads rows [r0, r1) of "w" on each of `ranks` ranks, without checksums, and returns the
// bytes read from storage and the bytes needed, over all ranks.
Result<std::pair<uint64_t, uint64_t>> LoadRowBands(const std::string& uri, int ranks, float salt) {
  std::vector<uint64_t> read(ranks, 0), needed(ranks, 0);
  TESSERA_RETURN_IF_ERROR(FirstError(RunLocalRanks(ranks, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    const int64_t r0 = kRows * r / ranks, r1 = kRows * (r + 1) / ranks;
    std::vector<float> w(static_cast<size_t>((r1 - r0) * kCols), -1.0f);
    StateDict dict;
    TESSERA_RETURN_IF_ERROR(dict.Add(ShardedTensor::Shard(
        "w", TensorView(w.data(), DType::kF32, {r1 - r0, kCols}), {kRows, kCols}, {r0, 0})));
    LoadOptions options;
    options.unexpected_keys = KeyPolicy::kSkip;
    options.verify_checksums = false;
    TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(dict, uri, comm, options));
    read[r] = report.bytes_read;
    needed[r] = report.bytes_needed;
    for (int64_t row = r0; row < r1; ++row) {
      for (int64_t c = 0; c < kCols; ++c) {
        if (w[(row - r0) * kCols + c] != W(row, c, salt)) return DataLoss("w differs");
      }
    }
    return Status::Ok();
  })));
  std::pair<uint64_t, uint64_t> out{0, 0};
  for (int r = 0; r < ranks; ++r) {
    out.first += read[r];
    out.second += needed[r];
  }
  return out;
}

TEST_F(S3CheckpointTest, SaveOnFourRanksLoadReshardedOnThreeVerify) {
  const std::string uri = base_ + "/ckpt";
  ASSERT_OK(SaveRanks(uri, 4, 1.0f));
  // Another layout (bands of columns), every byte checked against its checksum blocks.
  ASSERT_OK(LoadAndCheck(uri, 3, 1.0f));
  // Bands of rows that cut the saved ones: ranged reads of exactly the bytes needed.
  Result<std::pair<uint64_t, uint64_t>> bands = LoadRowBands(uri, 3, 1.0f);
  ASSERT_OK(bands.status());
  EXPECT_EQ(bands->first, bands->second);
  EXPECT_EQ(bands->second, uint64_t{kRows * kCols * 4});
  Result<VerifyReport> verified = Verify(uri);
  ASSERT_OK(verified.status());
  EXPECT_GT(verified->bytes_checked, uint64_t{kRows * kCols * 4 - 1});
  Result<Metadata> metadata = ReadMetadata(uri);
  ASSERT_OK(metadata.status());
  EXPECT_EQ(metadata->num_ranks, 4);
  Result<bool> committed = IsCommitted(uri);
  ASSERT_OK(committed.status());
  EXPECT_TRUE(*committed);
  Result<bool> nothing = IsCommitted(base_ + "/absent");
  ASSERT_OK(nothing.status());
  EXPECT_FALSE(*nothing);
}

// Issue 34: a save's requests beyond its uploads do not grow with its data files or the depth
// of its path: no HEAD of a data file (the create-only upload refuses a taken name), no walk up
// the parents (S3's directories are key prefixes), the new commit read back once and taken as
// read by the cleanup, the save's own marker not read. What remains, counted below:
//   HEAD: the empty directory (first save: is it an object?) or, in the second, the commit
//         below the new one (is the new one above it?); the number above the new commit (the
//         cleanup's probe for a newer commit). The marker and the files the cleanup removes
//         are deleted without a look first (RemoveIfPresent).
//   GET:  the new commit read back, and in the second save the first commit (the cleanup reads
//         every commit below the newest): each opened and read in one ranged GET, no HEAD.
//   LIST: the preparation's, the commit's, the cleanup's, the probe's (is the number above a
//         directory?), and in the first save the commit's check that no commit lies below.
TEST_F(S3CheckpointTest, ASaveSendsNoRequestPerDataFileOrParentDirectory) {
  const std::string uri = base_ + "/a/b/c/d/ckpt";
  Result<std::pair<std::shared_ptr<Storage>, std::string>> opened = OpenStorage(uri);
  ASSERT_OK(opened.status());
  auto* s3 = dynamic_cast<S3Storage*>(opened->first.get());
  ASSERT_NE(s3, nullptr);
  SaveOptions options;
  options.storage = opened->first;
  options.num_io_threads = 4;  // several data files per rank
  uint64_t first_files = 0;
  for (int save = 0; save < 2; ++save) {
    const s3::S3Stats before = s3->client().stats();
    ASSERT_OK(SaveRanks(opened->second, 2, 1.0f + static_cast<float>(save), options));
    const s3::S3Stats after = s3->client().stats();
    auto sent = [&](s3::S3Op op) { return Sent(before, after, op); };
    Result<Metadata> metadata = ReadMetadata(uri);
    ASSERT_OK(metadata.status());
    const uint64_t files = metadata->files.size();
    EXPECT_GE(files, 4u);
    SCOPED_TRACE("save " + std::to_string(save) + ", " + std::to_string(files) + " data files");
    EXPECT_EQ(after.retries, before.retries);
    const uint64_t removed = save == 0 ? 0 : first_files + 1;  // the first save's files, commit
    EXPECT_EQ(sent(s3::S3Op::kHead), 2u);
    EXPECT_EQ(sent(s3::S3Op::kList), save == 0 ? 5u : 4u);
    EXPECT_EQ(sent(s3::S3Op::kGet), save == 0 ? 1u : 2u);  // the commits: the new, the first
    // Each data file in one PUT (they are small), the marker, the commit and the hint.
    EXPECT_EQ(sent(s3::S3Op::kPut), files + 3);
    EXPECT_EQ(sent(s3::S3Op::kCreateMultipart), 0u);
    EXPECT_EQ(sent(s3::S3Op::kDelete), 1u + removed);  // the marker, and what the cleanup removes
    first_files = files;
  }
  ASSERT_OK(LoadAndCheck(uri, 3, 2.0f));
}

// A load opens each data file and reads its safetensors header in one ranged GET (no HEAD per
// file, no separate GETs of the header's length and text), and the manifest likewise: the HEADs
// a load sends do not grow with its data files.
TEST_F(S3CheckpointTest, ALoadOpensEachDataFileWithOneRequest) {
  const std::string uri = base_ + "/ckpt";
  Result<std::pair<std::shared_ptr<Storage>, std::string>> opened = OpenStorage(uri);
  ASSERT_OK(opened.status());
  auto* s3 = dynamic_cast<S3Storage*>(opened->first.get());
  ASSERT_NE(s3, nullptr);
  SaveOptions save;
  save.storage = opened->first;
  save.num_io_threads = 4;  // several data files per rank
  ASSERT_OK(SaveRanks(opened->second, 2, 1.0f, save));
  Result<Metadata> metadata = ReadMetadata(uri);
  ASSERT_OK(metadata.status());
  ASSERT_GE(metadata->files.size(), 4u);
  const s3::S3Stats before = s3->client().stats();
  ASSERT_OK(LoadAndCheck(opened->second, 2, 1.0f, nullptr, opened->first));
  const s3::S3Stats after = s3->client().stats();
  auto sent = [&](s3::S3Op op) { return Sent(before, after, op); };
  EXPECT_EQ(after.retries, before.retries);
  // The checkpoint directory's Stat; no data file, no manifest.
  EXPECT_LE(sent(s3::S3Op::kHead), 1u);
  // The manifest, then at most one GET per data file and rank: its header and its bytes in
  // one (they are small). Two GETs per header, as before, make at least 2 per opened file.
  EXPECT_LE(sent(s3::S3Op::kGet), 1 + 2 * metadata->files.size());
}

// SaveOptions::num_io_threads 0 (the default) writes one data file per rank on S3, whose parts
// upload in parallel anyway (a second file would add its create and completion requests), and
// 2 on a file system; a number given is taken as it is.
TEST_F(S3CheckpointTest, ADefaultSaveWritesOneDataFilePerRankOnS3) {
  auto files_of = [](const std::string& where) -> uint64_t {
    Result<Metadata> metadata = ReadMetadata(where);
    EXPECT_TRUE(metadata.ok()) << metadata.status().ToString();
    return metadata.ok() ? metadata->files.size() : 0;
  };
  const std::string uri = base_ + "/ckpt";
  ASSERT_OK(SaveRanks(uri, 2, 1.0f));
  EXPECT_EQ(files_of(uri), 2u);
  ASSERT_OK(LoadAndCheck(uri, 2, 1.0f));
  SaveOptions two;
  two.num_io_threads = 2;
  ASSERT_OK(SaveRanks(uri, 2, 2.0f, two));
  const uint64_t two_files = files_of(uri);
  EXPECT_GT(two_files, 2u);
  ASSERT_OK(LoadAndCheck(uri, 2, 2.0f));
  const std::string dir = ::testing::TempDir() + "/default_threads_" + std::to_string(getpid());
  ASSERT_OK(SaveRanks(dir, 2, 1.0f));
  EXPECT_EQ(files_of(dir), two_files) << "the default on a file system is 2";
  std::filesystem::remove_all(dir);
}

TEST_F(S3CheckpointTest, NewSaveReplacesOldAndAFailedSaveLeavesTheLastLoadable) {
  const std::string uri = base_ + "/ckpt";
  ASSERT_OK(SaveRanks(uri, 2, 1.0f));
  ASSERT_OK(SaveRanks(uri, 2, 2.0f));
  ASSERT_OK(LoadAndCheck(uri, 2, 2.0f));
  // A save that dies part-way through its data files (every storage operation fails from the
  // third on, as if the process were gone): nothing of it is visible, the last one loads.
  for (int64_t fail_at : {1, 3, 6}) {
    Result<std::pair<std::shared_ptr<Storage>, std::string>> opened = OpenStorage(uri);
    ASSERT_OK(opened.status());
    auto faulty = std::make_shared<FaultInjectingStorage>(
        opened->first, FaultPlan{.fail_at = fail_at, .crash = true, .path_filter = ""});
    SaveOptions options;
    options.storage = faulty;
    Status failed = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
      const int r = comm.rank();
      Part part;
      TESSERA_RETURN_IF_ERROR(BuildPart(part, kRows * r / 2, kRows * (r + 1) / 2, kCols * r / 2,
                                        kCols * (r + 1) / 2, 3.0f, true, r == 0));
      return Save(part.dict, opened->second, comm, options).status();
    }));
    EXPECT_FALSE(failed.ok()) << "fail_at " << fail_at;
    EXPECT_TRUE(Ok(LoadAndCheck(uri, 2, 2.0f))) << "after a save failed at operation " << fail_at;
    ASSERT_OK(Verify(uri).status());
  }
  // And the next save succeeds over what the failed ones left.
  ASSERT_OK(SaveRanks(uri, 2, 4.0f));
  ASSERT_OK(LoadAndCheck(uri, 3, 4.0f));
}

TEST_F(S3CheckpointTest, TorchDistSaveOnS3) {
  // PyTorch DCP's layout: zip items back to back, `.metadata` committed last.
  const std::string uri = base_ + "/dcp";
  SaveOptions options;
  options.format = CheckpointFormat::kTorchDist;
  ASSERT_OK(SaveRanks(uri, 2, 9.0f, options));
  Result<Metadata> metadata = ReadMetadata(uri);
  ASSERT_OK(metadata.status());
  EXPECT_EQ(metadata->format, CheckpointFormat::kTorchDist);
  ASSERT_OK(LoadAndCheck(uri, 3, 9.0f));
  ASSERT_OK(Verify(uri).status());
}

TEST_F(S3CheckpointTest, AsyncSaveUploadsInTheBackground) {
  const std::string uri = base_ + "/async";
  ASSERT_OK(FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    Part part;
    TESSERA_RETURN_IF_ERROR(BuildPart(part, kRows * r / 2, kRows * (r + 1) / 2, kCols * r / 2,
                                      kCols * (r + 1) / 2, 5.0f, true, r == 0));
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle handle, AsyncSave(part.dict, uri, comm));
    return handle.Wait();
  })));
  ASSERT_OK(LoadAndCheck(uri, 1, 5.0f));
}

TEST_F(S3CheckpointTest, RankLocalSaveAndFinalize) {
  const std::string uri = base_ + "/local";
  SaveOptions options;
  options.collective = false;
  options.save_tag = "step-1";
  ASSERT_OK(SaveRanks(uri, 3, 6.0f, options));
  ASSERT_OK(LoadAndCheck(uri, 2, 6.0f));
  Result<Metadata> merged = Finalize(uri);
  ASSERT_OK(merged.status());
  ASSERT_OK(LoadAndCheck(uri, 2, 6.0f));
  ASSERT_OK(Verify(uri).status());
}

TEST_F(S3CheckpointTest, RemoveKeys) {
  const std::string uri = base_ + "/rm";
  ASSERT_OK(SaveRanks(uri, 2, 7.0f));
  Result<RemoveKeysReport> removed = RemoveKeys(uri, {"b"});
  ASSERT_OK(removed.status());
  Result<Metadata> metadata = ReadMetadata(uri);
  ASSERT_OK(metadata.status());
  ASSERT_EQ(metadata->tensors.size(), 1u);
  EXPECT_EQ(metadata->tensors[0].key, "w");
  ASSERT_OK(Verify(uri).status());
}

TEST_F(S3CheckpointTest, ConvertBetweenLocalFilesAndS3BothWays) {
  testing::TempDir dir;
  const std::string uri = base_ + "/src";
  ASSERT_OK(SaveRanks(uri, 2, 8.0f));
  // S3 -> local: the source read with ranged reads, the output renamed into place.
  ConvertOptions to_tessera;
  to_tessera.to = CheckpointFormat::kTessera;
  const std::string local = dir.path() + "/local";
  ASSERT_OK(Convert(uri, local, to_tessera).status());
  ASSERT_OK(LoadAndCheck(local, 2, 8.0f));
  // local -> S3: made in a local directory, uploaded with its manifest last.
  const std::string back = base_ + "/back";
  Result<ConvertReport> uploaded = Convert(local, back, to_tessera);
  ASSERT_OK(uploaded.status());
  ASSERT_OK(LoadAndCheck(back, 3, 8.0f));
  ASSERT_OK(Verify(back).status());
  // Every format, S3 to S3.
  for (CheckpointFormat format : {CheckpointFormat::kSafetensors, CheckpointFormat::kTorchDist}) {
    ConvertOptions options;
    options.to = format;
    const std::string out = base_ + "/out-" + CheckpointFormatName(format);
    ASSERT_TRUE(Ok(Convert(uri, out, options).status())) << CheckpointFormatName(format);
    Result<Metadata> m = ReadMetadata(out);
    ASSERT_TRUE(Ok(m.status())) << CheckpointFormatName(format);
    EXPECT_EQ(m->format, format);
    EXPECT_TRUE(Ok(LoadAndCheck(out, 2, 8.0f))) << CheckpointFormatName(format);
  }
  // A destination that holds something is refused, naming it; nothing is changed.
  const Status again = Convert(local, back, to_tessera).status();
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.ToString();
  EXPECT_THAT(again.message(), HasSubstr(back));
  ASSERT_OK(LoadAndCheck(back, 1, 8.0f));
  // Several ranks converting into S3: refused before anything is written.
  const Status ranks = FirstError(RunLocalRanks(
      2, [&](Comm& comm) { return Convert(local, base_ + "/two", to_tessera, comm).status(); }));
  EXPECT_EQ(ranks.code(), StatusCode::kUnimplemented) << ranks.ToString();
}

TEST_F(S3CheckpointTest, MscProfileSavesAndLoadsAsMegatronNamesIt) {
  // Megatron's multi-storage-client paths: msc://profile/path, the profile an S3 one whose
  // base_path is bucket/prefix. Saved through MSC, read back through s3://.
  testing::TempDir dir;
  const std::string prefix = s3::testing::UniquePrefix();
  {
    std::ofstream config(dir.path() + "/msc.yaml");
    config << "profiles:\n  train:\n    storage_provider:\n      type: s3\n"
           << "      options:\n        base_path: " << server_->bucket() << "/" << prefix << "\n"
           << "        endpoint_url: " << server_->endpoint() << "\n"
           << "        region_name: us-east-1\n";
  }
  Set("MSC_CONFIG", dir.path() + "/msc.yaml");
  ASSERT_OK(SaveRanks("msc://train/ckpt/iter_0000001", 2, 10.0f));
  ASSERT_OK(LoadAndCheck("msc://train/ckpt/iter_0000001", 3, 10.0f));
  const std::string uri = "s3://" + server_->bucket() + "/" + prefix + "/ckpt/iter_0000001";
  ASSERT_OK(LoadAndCheck(uri, 1, 10.0f));
  ASSERT_OK(Verify("msc://train/ckpt/iter_0000001").status());
}

TEST_F(S3CheckpointTest, UnknownBucketAndSchemeAreClearErrors) {
  const Status bucket = ReadMetadata("s3://no-such-bucket-tessera/ckpt").status();
  EXPECT_FALSE(bucket.ok());
  EXPECT_THAT(bucket.ToString(), HasSubstr("no-such-bucket-tessera"));
  StateDict empty;
  const Status scheme = Save(empty, "gs://bucket/ckpt").status();
  EXPECT_EQ(scheme.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(scheme.message(), HasSubstr("gs://"));
}

}  // namespace
}  // namespace tessera
