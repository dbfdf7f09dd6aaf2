// S3Storage on moto's server: what differs from a file system (no positional writes, objects
// published whole at Sync/Close, key prefixes for directories, no rename), and faults through
// the Storage interface. The shared Storage suite (storage_test.cc) runs on it too.
#include "tessera/s3_storage.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "storage/s3/s3_client.h"
#include "storage/s3/testing/moto_server.h"
#include "storage/s3/testing/s3_test_util.h"
#include "tessera/testing/storage_suite.h"

namespace tessera {
namespace {

using s3::testing::Pattern;
using s3::testing::ScriptedFaults;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using Decision = s3::HttpFaultHook::Decision;

// ---- the conformance suite ------------------------------------------------------------------

// An S3Storage on moto's server (started by the test, signatures enforced), rooted at a key
// prefix of its own. Every case must leave no multipart upload behind.
class S3SuiteEnv : public testing::StorageSuiteEnv {
 public:
  S3SuiteEnv(std::shared_ptr<S3Storage> storage, std::string root)
      : storage_(std::move(storage)), root_(std::move(root)) {}
  ~S3SuiteEnv() override {
    Result<std::vector<s3::UploadListing::Upload>> uploads =
        storage_->client().ListMultipartUploads(storage_->bucket(), root_ + "/");
    EXPECT_TRUE(uploads.ok() && uploads->empty())
        << "multipart uploads left behind under " << root_;
  }
  Storage& storage() override { return *storage_; }
  const std::string& root() const override { return root_; }

 private:
  std::shared_ptr<S3Storage> storage_;
  std::string root_;
};

// A server that cannot start fails every case with the reason: none skips.
Result<std::unique_ptr<testing::StorageSuiteEnv>> MakeS3SuiteEnv() {
  TESSERA_ASSIGN_OR_RETURN(s3::testing::MotoServer * server, s3::testing::SharedMotoServer());
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<s3::S3Client> client,
                           s3::S3Client::Create(server->ClientOptions()));
  return std::unique_ptr<testing::StorageSuiteEnv>(
      new S3SuiteEnv(std::make_shared<S3Storage>(std::move(client), server->bucket()),
                     s3::testing::UniquePrefix()));
}

// No rename, no positional writes, no directories of their own: Publish is a conditional put.
TESSERA_INSTANTIATE_STORAGE_SUITE(S3, MakeS3SuiteEnv,
                                  (StorageCapabilities{.conditional_create = true}));

// ---- what is particular to S3 ---------------------------------------------------------------

#define S3S_ASSERT_OK(expr)                                            \
  do {                                                                 \
    const ::tessera::Status _s = ::tessera::internal::GetStatus(expr); \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s.ToString();            \
  } while (0)

class S3StorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<s3::testing::MotoServer*> server = s3::testing::SharedMotoServer();
    ASSERT_TRUE(server.ok()) << "could not start the S3 test server: "
                             << server.status().ToString();
    server_ = *server;
    root_ = s3::testing::UniquePrefix();
    storage_ = NewStorage();
  }

  std::shared_ptr<S3Storage> NewStorage(std::shared_ptr<s3::HttpFaultHook> hook = nullptr,
                                        int max_attempts = 10) {
    s3::S3ClientOptions options = server_->ClientOptions();
    options.http.fault_hook = std::move(hook);
    options.retry.max_attempts = max_attempts;
    Result<std::shared_ptr<s3::S3Client>> client = s3::S3Client::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return std::make_shared<S3Storage>(*client, server_->bucket());
  }

  std::string Path(const std::string& name) const { return root_ + "/" + name; }

  Status Write(Storage& s, const std::string& path, std::span<const std::byte> data,
               size_t piece = 1u << 20, CreateMode mode = CreateMode::kExclusive) {
    TESSERA_ASSIGN_OR_RETURN(auto w, s.NewWritableFile(path, mode));
    for (size_t done = 0; done < data.size();) {
      const size_t n = std::min(piece, data.size() - done);
      TESSERA_RETURN_IF_ERROR(w->WriteAt(done, data.data() + done, n));
      done += n;
    }
    return w->Close();
  }

  Result<std::vector<std::byte>> Read(Storage& s, const std::string& path) {
    TESSERA_ASSIGN_OR_RETURN(auto r, s.NewReadableFile(path));
    std::vector<std::byte> out(r->size());
    TESSERA_RETURN_IF_ERROR(r->ReadAt(0, out.data(), out.size()));
    return out;
  }

  FileType TypeOf(const std::string& path) {
    Result<FileType> t = storage_->Stat(path);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? *t : FileType::kNotFound;
  }

  std::vector<std::string> Uploads() {
    auto u = storage_->client().ListMultipartUploads(storage_->bucket(), root_ + "/");
    EXPECT_TRUE(u.ok()) << u.status().ToString();
    std::vector<std::string> keys;
    if (u.ok()) {
      for (const auto& upload : *u) keys.push_back(upload.key);
    }
    return keys;
  }

  s3::testing::MotoServer* server_ = nullptr;
  std::string root_;
  std::shared_ptr<S3Storage> storage_;
};

TEST_F(S3StorageTest, CapabilitiesAndRename) {
  const StorageCapabilities c = storage_->capabilities();
  EXPECT_FALSE(c.rename);
  EXPECT_FALSE(c.positional_writes);
  EXPECT_FALSE(c.directory_sync);
  EXPECT_TRUE(c.conditional_create);
  const Status s = storage_->Rename(Path("a"), Path("b"));
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("S3 has no rename"));
  EXPECT_THAT(s.message(), HasSubstr(Path("a")));
}

TEST_F(S3StorageTest, KeysAreNormalisedPaths) {
  EXPECT_EQ(S3Storage::KeyOf("/ckpt//step 1/./x"), "ckpt/step 1/x");
  EXPECT_EQ(S3Storage::KeyOf("a/b/../c/"), "a/c");
  EXPECT_EQ(S3Storage::KeyOf("../a"), "a");
  EXPECT_EQ(S3Storage::KeyOf("/"), "");
  EXPECT_EQ(storage_->NewWritableFile("/").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(S3StorageTest, WritesAreFrontToBackOnly) {
  const std::string path = Path("seq");
  auto w = storage_->NewWritableFile(path);
  ASSERT_TRUE(w.ok());
  S3S_ASSERT_OK((*w)->WriteAt(0, "abc", 3));
  const Status back = (*w)->WriteAt(0, "X", 1);
  EXPECT_EQ(back.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(back.message(), HasSubstr(path));
  EXPECT_THAT(back.message(), HasSubstr("at offset 0"));
  EXPECT_THAT(back.message(), HasSubstr("next byte is at offset 3"));
  EXPECT_EQ((*w)->WriteAt(10, "gap", 3).code(), StatusCode::kUnimplemented);
  S3S_ASSERT_OK((*w)->WriteAt(3, "def", 3));  // the file is still usable
  S3S_ASSERT_OK((*w)->Close());
  Result<std::vector<std::byte>> got = Read(*storage_, path);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(got->data()), got->size()), "abcdef");
}

TEST_F(S3StorageTest, AFileIsInvisibleUntilSyncOrClose) {
  for (bool sync : {true, false}) {
    const std::string path = Path(sync ? "synced" : "closed");
    auto w = storage_->NewWritableFile(path);
    ASSERT_TRUE(w.ok());
    S3S_ASSERT_OK((*w)->WriteAt(0, "data", 4));
    EXPECT_EQ(TypeOf(path), FileType::kNotFound);
    EXPECT_EQ(storage_->NewReadableFile(path).status().code(), StatusCode::kNotFound);
    S3S_ASSERT_OK(sync ? (*w)->Sync() : (*w)->Close());
    EXPECT_EQ(TypeOf(path), FileType::kFile);
    const Status more = (*w)->WriteAt(4, "x", 1);
    EXPECT_EQ(more.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(more.message(), HasSubstr(path));
    S3S_ASSERT_OK((*w)->Close());
  }
}

TEST_F(S3StorageTest, AFileDestroyedUnclosedPublishesNothingAndLeavesNoParts) {
  const std::string path = Path("abandoned");
  {
    auto w = storage_->NewWritableFile(path);
    ASSERT_TRUE(w.ok());
    const std::vector<std::byte> data = Pattern(12u << 20, 1);  // two full parts uploaded
    S3S_ASSERT_OK((*w)->WriteAt(0, data.data(), data.size()));
  }
  EXPECT_EQ(TypeOf(path), FileType::kNotFound);
  EXPECT_THAT(Uploads(), IsEmpty());
}

TEST_F(S3StorageTest, LargeFilesStreamAsPartsAndReadBackInParallel) {
  const std::string path = Path("big.safetensors");
  const std::vector<std::byte> data = Pattern((21u << 20) + 5, 2);
  storage_->client().ResetStats();
  S3S_ASSERT_OK(Write(*storage_, path, data, 1'000'001));
  const s3::S3Stats stats = storage_->client().stats();
  EXPECT_EQ(stats.requests[static_cast<size_t>(s3::S3Op::kUploadPart)], 5u);
  EXPECT_EQ(stats.requests[static_cast<size_t>(s3::S3Op::kPut)], 0u);
  auto r = storage_->NewReadableFile(path);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ((*r)->size(), data.size());
  // Several readers at once, each of a range of its own.
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<Status> statuses(kThreads);
  std::vector<std::vector<std::byte>> parts(kThreads);
  const size_t each = data.size() / kThreads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const size_t n = t == kThreads - 1 ? data.size() - t * each : each;
      parts[t].resize(n);
      statuses[t] = (*r)->ReadAt(t * each, parts[t].data(), n);
    });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    S3S_ASSERT_OK(statuses[t]);
    EXPECT_EQ(std::memcmp(parts[t].data(), data.data() + t * each, parts[t].size()), 0) << t;
  }
}

TEST_F(S3StorageTest, AnExclusiveFileLosesToAnObjectCreatedMeanwhile) {
  for (size_t size : {size_t{100}, size_t{11u << 20}}) {  // one PUT; multipart
    const std::string path = Path("race" + std::to_string(size));
    auto w = storage_->NewWritableFile(path);  // absent when opened
    ASSERT_TRUE(w.ok());
    S3S_ASSERT_OK(storage_->Publish(path, Pattern(7, 3), PublishMode::kReplace, true));
    const std::vector<std::byte> data = Pattern(size, 4);
    S3S_ASSERT_OK((*w)->WriteAt(0, data.data(), data.size()));
    const Status closed = (*w)->Close();
    EXPECT_EQ(closed.code(), StatusCode::kAlreadyExists) << closed.ToString();
    EXPECT_THAT(closed.message(), HasSubstr(path));
    Result<std::vector<std::byte>> got = Read(*storage_, path);
    ASSERT_TRUE(got.ok());
    EXPECT_TRUE(*got == Pattern(7, 3)) << "the existing object was overwritten";
  }
  EXPECT_THAT(Uploads(), IsEmpty());
  // And opening a name that exists fails at once.
  const Status exists = storage_->NewWritableFile(Path("race100")).status();
  EXPECT_EQ(exists.code(), StatusCode::kAlreadyExists);
}

TEST_F(S3StorageTest, AReaderOfAReplacedObjectGetsDataLossNeverAMix) {
  const std::string path = Path("replaced");
  S3S_ASSERT_OK(Write(*storage_, path, Pattern(1000, 5)));
  auto r = storage_->NewReadableFile(path);
  ASSERT_TRUE(r.ok());
  S3S_ASSERT_OK(Write(*storage_, path, Pattern(1000, 6), 1u << 20, CreateMode::kTruncate));
  std::vector<std::byte> buf(10);
  const Status s = (*r)->ReadAt(50, buf.data(), buf.size());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr("changed since it was opened"));
}

// A file opened with its prefix: one GET opens it; reads within the prefix send nothing; a
// read across its end fetches only the bytes past it, pinned to the ETag of the open (a
// replaced object is kDataLoss, never a mix of the old head and the new tail).
TEST_F(S3StorageTest, AFileOpenedWithItsPrefixFetchesOnlyWhatItDoesNotHold) {
  const std::string path = Path("headed");
  const std::vector<std::byte> data = Pattern(100000, 3);
  S3S_ASSERT_OK(Write(*storage_, path, data));
  storage_->client().ResetStats();
  auto r = storage_->NewReadableFileWithPrefix(path, 4096);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->size(), data.size());
  EXPECT_EQ(storage_->client().stats().bytes_received, 4096u);
  std::vector<std::byte> buf(5000);
  S3S_ASSERT_OK((*r)->ReadAt(0, buf.data(), 4096));
  EXPECT_EQ(storage_->client().stats().bytes_received, 4096u) << "served from the prefix";
  S3S_ASSERT_OK((*r)->ReadAt(96, buf.data(), buf.size()));
  EXPECT_TRUE(std::equal(buf.begin(), buf.end(), data.begin() + 96));
  EXPECT_EQ(storage_->client().stats().bytes_received, 4096u + (96 + 5000 - 4096));
  EXPECT_EQ(storage_->client().stats().requests[static_cast<size_t>(s3::S3Op::kHead)], 0u);
  S3S_ASSERT_OK(Write(*storage_, path, Pattern(100000, 4), 1u << 20, CreateMode::kTruncate));
  const Status mixed = (*r)->ReadAt(4000, buf.data(), 200);
  EXPECT_EQ(mixed.code(), StatusCode::kDataLoss) << mixed.ToString();
  EXPECT_THAT(mixed.message(), HasSubstr("changed since it was opened"));
}

TEST_F(S3StorageTest, DirectoriesAreKeyPrefixes) {
  S3S_ASSERT_OK(storage_->CreateDirs(Path("empty/dir")));  // nothing to create
  EXPECT_EQ(TypeOf(Path("empty")), FileType::kNotFound);
  Result<std::vector<std::string>> none = storage_->ListDir(Path("empty"));
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_THAT(*none, IsEmpty());
  S3S_ASSERT_OK(storage_->SyncDir(Path("anything")));

  const std::vector<std::byte> one = Pattern(1, 7);
  for (const char* name : {"d/b", "d/a", "d/sub/x", "d/sub/y/z", "d2/q", "a", "a/inner"}) {
    S3S_ASSERT_OK(Write(*storage_, Path(name), one));
  }
  // A "directory marker" object (what consoles create for folders) is not an entry.
  S3S_ASSERT_OK(storage_->client().PutObject(storage_->bucket(), root_ + "/d/", {}, false));
  Result<std::vector<std::string>> d = storage_->ListDir(Path("d"));
  ASSERT_TRUE(d.ok());
  EXPECT_THAT(*d, ElementsAre("a", "b", "sub"));
  Result<std::vector<std::string>> top = storage_->ListDir("/" + root_ + "/");
  ASSERT_TRUE(top.ok());
  EXPECT_THAT(*top, ElementsAre("a", "d", "d2"));  // "a" is a file and a prefix: listed once
  EXPECT_EQ(TypeOf(Path("d/sub")), FileType::kDirectory);
  EXPECT_EQ(TypeOf(Path("a")), FileType::kFile);
  EXPECT_EQ(TypeOf(Path("d/su")), FileType::kNotFound);  // a prefix, not a path component
  EXPECT_EQ(TypeOf(""), FileType::kDirectory);           // the bucket

  EXPECT_EQ(storage_->Remove(Path("d/sub")).code(), StatusCode::kIOError);
  EXPECT_EQ(storage_->Remove(Path("d/nope")).code(), StatusCode::kNotFound);
  EXPECT_EQ(storage_->RemoveDir(Path("d/sub")).code(), StatusCode::kIOError);  // not empty
  EXPECT_EQ(storage_->RemoveDir(Path("d/a")).code(), StatusCode::kIOError);    // a file
  S3S_ASSERT_OK(storage_->Remove(Path("d/sub/x")));
  S3S_ASSERT_OK(storage_->Remove(Path("d/sub/y/z")));
  S3S_ASSERT_OK(storage_->RemoveDir(Path("d/sub")));  // empty now, which is gone on S3
  EXPECT_EQ(TypeOf(Path("d/sub")), FileType::kNotFound);
}

TEST_F(S3StorageTest, ListingsPageThroughManyEntries) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  constexpr int kFiles = 1203;  // more than one page of 1000
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const std::vector<std::byte> one = Pattern(1, 8);
      for (int i = t; i < kFiles; i += 4) {
        if (!storage_
                 ->Publish(Path("many/f" + std::to_string(i)), one, PublishMode::kCreateOnly, false)
                 .ok()) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  Result<std::vector<std::string>> names = storage_->ListDir(Path("many"));
  ASSERT_TRUE(names.ok()) << names.status().ToString();
  EXPECT_EQ(names->size(), static_cast<size_t>(kFiles));
  EXPECT_TRUE(std::is_sorted(names->begin(), names->end()));
}

TEST_F(S3StorageTest, AMissingBucketIsNamed) {
  S3Storage missing(std::shared_ptr<s3::S3Client>(storage_, &storage_->client()),
                    "no-such-bucket-tessera");
  const Status open = missing.NewReadableFile("k").status();
  EXPECT_EQ(open.code(), StatusCode::kNotFound);
  EXPECT_THAT(open.message(), HasSubstr("NoSuchBucket"));
  EXPECT_THAT(missing.Stat("k").status().message(), HasSubstr("NoSuchBucket"));
  EXPECT_THAT(missing.ListDir("d").status().message(), HasSubstr("NoSuchBucket"));
  const Status write = missing.NewWritableFile("k").status();
  EXPECT_THAT(write.message(), HasSubstr("NoSuchBucket"));
}

// Throttling through the Storage interface: the file is written and read as if nothing
// happened, and the retries show in the counters.
TEST_F(S3StorageTest, ThrottledWritesAndReadsSucceed) {
  auto faults = std::make_shared<ScriptedFaults>(
      [](const s3::HttpRequest&, const std::string& kind, int nth) {
        const bool data = kind == "UploadPart" || kind == "GetObject" || kind == "PutObject" ||
                          kind == "CompleteMultipartUpload";
        return data && nth % 3 != 2 ? s3::testing::S3ErrorReply(503, "SlowDown") : Decision{};
      });
  auto storage = NewStorage(faults);
  const std::vector<std::byte> data = Pattern(11u << 20, 9);
  S3S_ASSERT_OK(Write(*storage, Path("throttled"), data));
  Result<std::vector<std::byte>> got = Read(*storage, Path("throttled"));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == data);
  EXPECT_GE(storage->client().stats().retries, 10u);
}

// The writer dies between its last part and the completion (every request from then on is
// lost): no object is visible, listings show nothing, and the cleanup finds the upload.
TEST_F(S3StorageTest, ACrashBeforeTheCompletionLeavesNoVisibleObject) {
  std::atomic<bool> dead{false};
  auto faults =
      std::make_shared<ScriptedFaults>([&](const s3::HttpRequest&, const std::string& kind, int) {
        if (kind == "CompleteMultipartUpload") dead = true;
        return dead ? Decision{s3::HttpFaultHook::Action::kReset} : Decision{};
      });
  auto storage = NewStorage(faults, /*max_attempts=*/2);
  const std::string path = Path("ckpt/data_0.safetensors");
  const Status s = Write(*storage, path, Pattern(11u << 20, 10));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_EQ(TypeOf(path), FileType::kNotFound);
  Result<std::vector<std::string>> names = storage_->ListDir(Path("ckpt"));
  ASSERT_TRUE(names.ok());
  EXPECT_THAT(*names, IsEmpty());
  EXPECT_EQ(Uploads(), std::vector<std::string>{root_ + "/ckpt/data_0.safetensors"});
  // Listed with its start, under its directory only. (moto says every upload started on
  // 2010-11-10T20:48:33Z: the age is that old.)
  Result<std::vector<IncompleteUpload>> listed = storage_->ListIncompleteUploads(Path("ckpt"));
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].key, root_ + "/ckpt/data_0.safetensors");
  EXPECT_FALSE((*listed)[0].upload_id.empty());
  EXPECT_GE((*listed)[0].age_seconds, 0);
  Result<std::vector<IncompleteUpload>> elsewhere = storage_->ListIncompleteUploads(Path("other"));
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status().ToString();
  EXPECT_THAT(*elsewhere, IsEmpty());
  // Too young for an age of a century; then aborted at any age.
  Result<int> aborted =
      storage_->AbortIncompleteUploads(Path("ckpt"), std::chrono::hours(24 * 365 * 100));
  ASSERT_TRUE(aborted.ok()) << aborted.status().ToString();
  EXPECT_EQ(*aborted, 0);
  aborted = storage_->AbortIncompleteUploads(Path("ckpt"), std::chrono::seconds(0));
  ASSERT_TRUE(aborted.ok()) << aborted.status().ToString();
  EXPECT_EQ(*aborted, 1);
  EXPECT_THAT(Uploads(), IsEmpty());
}

// A part that fails for good: the write or the close fails naming the path, and the upload
// is aborted.
TEST_F(S3StorageTest, AFailedPartFailsTheFileAndAbortsItsUpload) {
  auto faults =
      std::make_shared<ScriptedFaults>([](const s3::HttpRequest& r, const std::string& kind, int) {
        return kind == "UploadPart" && r.url.find("partNumber=1&") != std::string::npos
                   ? s3::testing::S3ErrorReply(500, "InternalError")
                   : Decision{};
      });
  auto storage = NewStorage(faults, /*max_attempts=*/2);
  const std::string path = Path("failing");
  auto w = storage->NewWritableFile(path);
  ASSERT_TRUE(w.ok());
  const std::vector<std::byte> data = Pattern(16u << 20, 11);
  Status s;
  for (size_t done = 0; done < data.size() && s.ok(); done += 1u << 20) {
    s = (*w)->WriteAt(done, data.data() + done, 1u << 20);
  }
  const Status closed = (*w)->Close();
  const Status& first = s.ok() ? closed : s;
  EXPECT_THAT(first.message(), HasSubstr("HTTP 500 InternalError"));
  EXPECT_THAT(first.message(), HasSubstr(path));
  EXPECT_FALSE(closed.ok());
  EXPECT_EQ(TypeOf(path), FileType::kNotFound);
  EXPECT_THAT(Uploads(), IsEmpty());
}

}  // namespace
}  // namespace tessera
