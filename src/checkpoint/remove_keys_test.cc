// RemoveKeys: what it removes, keeps, copies and frees; refusals; corruption found while
// copying; a save that commits meanwhile. The crash tests are in checkpoint_test.cc.
#include "tessera/remove_keys.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "core/utf8.h"
#include "format/safetensors.h"
#include "format/tessera/manifest.h"
#include "tessera/checkpoint.h"
#include "tessera/memory_storage.h"
#include "tessera/storage_wrapper.h"
#include "testing/commits.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A model and its optimizer state: model.* tensors, optimizer.* tensors, objects of both.
// `big` tensors span several 256 KiB checksum blocks.
struct TrainState {
  // uint32_t holding F32 bits: compared bitwise (random bits include NaNs).
  std::vector<uint32_t> w, b, m_w, m_b;
  std::vector<uint8_t> step{1, 2, 3}, config{'c', 'f', 'g'};
  explicit TrainState(uint64_t seed, size_t big = 300 * 1024) : w(big), b(77), m_w(big), m_b(77) {
    testing::FillRandom(w.data(), w.size() * 4, seed);
    testing::FillRandom(b.data(), b.size() * 4, seed + 1);
    testing::FillRandom(m_w.data(), m_w.size() * 4, seed + 2);
    testing::FillRandom(m_b.data(), m_b.size() * 4, seed + 3);
  }
  StateDict Dict(bool with_optimizer = true) {
    StateDict s;
    const int64_t n = static_cast<int64_t>(w.size());
    (void)s.Add(ShardedTensor::Whole("model.w", TensorView(w.data(), DType::kF32, {n / 4, 4})));
    (void)s.Add(ShardedTensor::Whole("model.b", TensorView(b.data(), DType::kF32, {77})));
    (void)s.Add(ShardedObject{"model.config", config, {}});
    if (with_optimizer) {
      (void)s.Add(
          ShardedTensor::Whole("optimizer.m.w", TensorView(m_w.data(), DType::kF32, {n / 4, 4})));
      (void)s.Add(ShardedTensor::Whole("optimizer.m.b", TensorView(m_b.data(), DType::kF32, {77})));
      (void)s.Add(ShardedObject{"optimizer.step", step, {}});
    }
    return s;
  }
};

uint64_t Sum(const std::vector<FileInfo>& files) {
  uint64_t n = 0;
  for (const FileInfo& f : files) n += f.size;
  return n;
}

class RemoveKeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    save_.storage = storage_;
    save_.num_io_threads = 1;  // one file holds every key: removing one prefix rewrites it
    save_.user_metadata = {{"step", "1000"}};
    remove_.storage = storage_;
  }
  // The names in the directory.
  std::vector<std::string> Names() {
    Result<std::vector<std::string>> names = storage_->ListDir(path_);
    return names.ok() ? *names : std::vector<std::string>{};
  }
  // Loads the model part strictly (the optimizer must be gone) and compares it with `want`.
  void ExpectModelOnly(TrainState& want) {
    TrainState got(0, want.w.size());
    StateDict dict = got.Dict(/*with_optimizer=*/false);
    LoadOptions o;
    o.storage = storage_;
    ASSERT_OK(Load(dict, path_, o));
    EXPECT_EQ(got.w, want.w);
    EXPECT_EQ(got.b, want.b);
    EXPECT_EQ(std::get<ShardedObject>(*dict.Find("model.config")).data, want.config);
  }
  // Only the manifest and the files it lists remain: nothing stale, no marker.
  void ExpectNoStrayFiles() {
    ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path_, storage_));
    std::vector<std::string> commit = testing::CommitFiles(*storage_, path_);
    std::set<std::string> expected(commit.begin(), commit.end());
    for (const FileInfo& f : m.files) expected.insert(f.name);
    const std::vector<std::string> names = Names();
    EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), expected);
  }

  std::shared_ptr<MemoryStorage> storage_ = std::make_shared<MemoryStorage>();
  std::string path_ = "/ck";
  SaveOptions save_;
  RemoveKeysOptions remove_;
};

TEST_F(RemoveKeysTest, RewritesMixedFilesCopyingOnlyKeptChunksAndFreesTheRest) {
  TrainState state(1);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  ASSERT_OK_AND_ASSIGN(Metadata before, ReadMetadata(path_, storage_));
  ASSERT_EQ(before.files.size(), 1u);

  ASSERT_OK_AND_ASSIGN(RemoveKeysReport r, RemoveKeys(path_, {"optimizer."}, remove_));
  EXPECT_THAT(r.removed_tensors, ElementsAre("optimizer.m.b", "optimizer.m.w"));
  EXPECT_THAT(r.removed_objects, ElementsAre("optimizer.step"));
  EXPECT_THAT(r.matches_per_prefix, ElementsAre(3u));
  EXPECT_EQ(r.files_rewritten, 1);
  EXPECT_EQ(r.files_dropped, 0);
  EXPECT_EQ(r.bytes_copied, (state.w.size() + state.b.size()) * 4 + state.config.size());
  EXPECT_EQ(r.bytes_before, Sum(before.files));
  EXPECT_NE(r.save_id, before.save_id);

  ASSERT_OK_AND_ASSIGN(Metadata after, ReadMetadata(path_, storage_));
  EXPECT_EQ(after.save_id, r.save_id);
  EXPECT_EQ(Sum(after.files), r.bytes_after);
  EXPECT_EQ(static_cast<int>(after.files.size()), r.files_after);
  // The optimizer's bytes are gone from the disk, not only from the index.
  EXPECT_LT(r.bytes_after, r.bytes_before - (state.m_w.size() + state.m_b.size()) * 4 + 8192);
  EXPECT_EQ(after.tensors.size(), 2u);
  EXPECT_EQ(after.objects.size(), 1u);
  // Kept: the user metadata (plus the record of the removed prefix), the save time, the
  // chunks' checksums.
  std::map<std::string, std::string> want = before.user_metadata;
  want[kRemovedKeyPrefixesKey] = R"(["optimizer."])";
  EXPECT_EQ(after.user_metadata, want);
  EXPECT_EQ(after.save_time_unix_ms, before.save_time_unix_ms);
  EXPECT_EQ(after.FindTensor("model.w")->chunks[0].block_checksums,
            before.FindTensor("model.w")->chunks[0].block_checksums);
  EXPECT_GT(after.FindTensor("model.w")->chunks[0].block_checksums.size(), 0u);
  ExpectModelOnly(state);
  ASSERT_OK(Verify(path_, storage_));
  ExpectNoStrayFiles();
}

// Every removal that removed something adds its prefixes to the record, sorted and unique; a
// prefix that matched nothing is not recorded, and a removal of nothing writes nothing.
TEST_F(RemoveKeysTest, TheRemovedPrefixesAreRecordedInTheUserMetadata) {
  TrainState state(5, 100);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  ASSERT_OK(RemoveKeys(path_, {"optimizer.m.", "nothing."}, remove_));
  ASSERT_OK(RemoveKeys(path_, {"model.config", "optimizer.step"}, remove_));
  ASSERT_OK(RemoveKeys(path_, {"nothing."}, remove_));
  ASSERT_OK_AND_ASSIGN(Metadata after, ReadMetadata(path_, storage_));
  EXPECT_EQ(after.user_metadata.at(kRemovedKeyPrefixesKey),
            R"(["model.config","optimizer.m.","optimizer.step"])");
  EXPECT_EQ(after.user_metadata.at("step"), "1000");
}

TEST_F(RemoveKeysTest, SeparatePrefixFilesAreDroppedWithoutCopyingAnything) {
  save_.num_io_threads = 2;
  save_.separate_prefixes = {"optimizer."};
  TrainState state(2);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  ASSERT_OK_AND_ASSIGN(Metadata before, ReadMetadata(path_, storage_));
  EXPECT_THAT(before.separate_prefixes, ElementsAre("optimizer."));

  ASSERT_OK_AND_ASSIGN(RemoveKeysReport r, RemoveKeys(path_, {"optimizer."}, remove_));
  EXPECT_EQ(r.bytes_copied, 0u);
  EXPECT_EQ(r.files_rewritten, 0);
  EXPECT_EQ(r.files_dropped, 2);  // the optimizer's own two files
  ASSERT_OK_AND_ASSIGN(Metadata after, ReadMetadata(path_, storage_));
  // The model's files are the very same files.
  std::set<std::string> model_files;
  for (const TensorInfo& t : before.tensors) {
    if (t.key.starts_with("model.")) {
      model_files.insert(before.files[t.chunks[0].location.file_index].name);
    }
  }
  std::set<std::string> kept;
  for (const FileInfo& f : after.files) kept.insert(f.name);
  EXPECT_EQ(kept, model_files);
  EXPECT_EQ(after.separate_prefixes, before.separate_prefixes);
  ExpectModelOnly(state);
  ASSERT_OK(Verify(path_, storage_));
  ExpectNoStrayFiles();
}

TEST_F(RemoveKeysTest, DryRunReportsWhatARealRunDoesAndTouchesNothing) {
  TrainState state(3);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  const std::vector<std::string> names = Names();
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> manifest,
                       storage_->GetFileContents(testing::CommitPath(*storage_, path_)));
  remove_.dry_run = true;
  ASSERT_OK_AND_ASSIGN(RemoveKeysReport dry,
                       RemoveKeys(path_, {"optimizer.m", "model.b"}, remove_));
  EXPECT_TRUE(dry.dry_run);
  EXPECT_EQ(Names(), names);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> manifest_after,
                       storage_->GetFileContents(testing::CommitPath(*storage_, path_)));
  EXPECT_EQ(manifest_after, manifest);

  remove_.dry_run = false;
  ASSERT_OK_AND_ASSIGN(RemoveKeysReport real,
                       RemoveKeys(path_, {"optimizer.m", "model.b"}, remove_));
  EXPECT_EQ(real.removed_tensors, dry.removed_tensors);
  EXPECT_EQ(real.removed_objects, dry.removed_objects);
  EXPECT_THAT(real.matches_per_prefix, ElementsAre(2u, 1u));
  EXPECT_EQ(real.matches_per_prefix, dry.matches_per_prefix);
  EXPECT_EQ(real.bytes_copied, dry.bytes_copied);
  EXPECT_EQ(real.bytes_after, dry.bytes_after);
  EXPECT_EQ(real.files_after, dry.files_after);
  ASSERT_OK_AND_ASSIGN(Metadata after, ReadMetadata(path_, storage_));
  EXPECT_EQ(Sum(after.files), dry.bytes_after);
}

TEST_F(RemoveKeysTest, NothingMatchingWritesNothing) {
  TrainState state(4, 100);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  ASSERT_OK_AND_ASSIGN(Metadata before, ReadMetadata(path_, storage_));
  const std::vector<std::string> names = Names();
  ASSERT_OK_AND_ASSIGN(RemoveKeysReport r, RemoveKeys(path_, {"nope.", "model.x"}, remove_));
  EXPECT_TRUE(r.removed_tensors.empty());
  EXPECT_TRUE(r.removed_objects.empty());
  EXPECT_THAT(r.matches_per_prefix, ElementsAre(0u, 0u));
  EXPECT_EQ(r.save_id, before.save_id);
  EXPECT_EQ(r.bytes_after, r.bytes_before);
  EXPECT_EQ(Names(), names);
}

// Issue 30, defect 1: a prefix that is not UTF-8 (here the first byte of "é") made the JSON
// writer of the removed-prefix record throw, and the CLI abort. It is refused, naming it.
TEST_F(RemoveKeysTest, APrefixThatIsNotUtf8IsRefusedAndNothingChanges) {
  TrainState state(4, 100);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  ASSERT_OK_AND_ASSIGN(Metadata before, ReadMetadata(path_, storage_));
  const std::vector<std::string> names = Names();
  for (bool dry_run : {false, true}) {
    remove_.dry_run = dry_run;
    Result<RemoveKeysReport> r = RemoveKeys(path_, {"model.", "\xc3"}, remove_);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_THAT(r.status().message(), HasSubstr("\\xc3"));
    EXPECT_THAT(r.status().message(), HasSubstr("not valid UTF-8"));
  }
  EXPECT_EQ(Names(), names);
  ASSERT_OK_AND_ASSIGN(Metadata after, ReadMetadata(path_, storage_));
  EXPECT_EQ(after.save_id, before.save_id);
}

TEST_F(RemoveKeysTest, RemovingEveryKeyLeavesAnEmptyCheckpoint) {
  TrainState state(5, 100);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  ASSERT_OK_AND_ASSIGN(RemoveKeysReport r, RemoveKeys(path_, {"model.", "optimizer."}, remove_));
  EXPECT_EQ(r.files_dropped, 1);
  EXPECT_EQ(r.bytes_after, 0u);
  ASSERT_OK_AND_ASSIGN(Metadata after, ReadMetadata(path_, storage_));
  EXPECT_TRUE(after.tensors.empty());
  EXPECT_TRUE(after.objects.empty());
  EXPECT_TRUE(after.files.empty());
  ASSERT_OK(Verify(path_, storage_));
  ExpectNoStrayFiles();
}

TEST_F(RemoveKeysTest, BadArgumentsAndOtherFormatsAreRefusedNamingWhy) {
  TrainState state(6, 100);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  Result<RemoveKeysReport> r = RemoveKeys(path_, {}, remove_);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("no key prefix"));
  r = RemoveKeys(path_, {"model.", ""}, remove_);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("empty key prefix"));
  remove_.num_io_threads = 0;
  r = RemoveKeys(path_, {"model."}, remove_);
  EXPECT_THAT(r.status().message(), HasSubstr("num_io_threads must be at least 1, got 0"));
  remove_.num_io_threads = 2;
  r = RemoveKeys("/nothing", {"model."}, remove_);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);

  // A Hugging Face directory: one safetensors file of its own.
  std::vector<SafetensorsEntry> entries = {{"w", DType::kF32, {2}, 0, 0}};
  LayOutEntries(entries);
  ASSERT_OK_AND_ASSIGN(Bytes header, EncodeSafetensorsHeader(entries, {}));
  header.resize(header.size() + 8, 0);
  ASSERT_OK(storage_->CreateDirs("/hf"));
  storage_->SetFileContents("/hf/model.safetensors", header);
  ASSERT_OK(ReadMetadata("/hf", storage_).status());
  r = RemoveKeys("/hf", {"w"}, remove_);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("it is a safetensors checkpoint"));
  EXPECT_THAT(r.status().message(), HasSubstr("tessera checkpoints only"));
}

TEST_F(RemoveKeysTest, APrefixThatIsNotUtf8IsRefusedNamingItAndNothingChanges) {
  TrainState state(7, 100);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  const std::vector<std::string> names = Names();
  // "\xc3" alone: the first byte of a two-byte character (the CLI's `--prefix $'\xc3'`).
  for (const std::string& bad :
       {std::string("\xc3"), std::string("model.\xff"), std::string("\xed\xa0\x80")}) {
    remove_.dry_run = false;
    Result<RemoveKeysReport> r = RemoveKeys(path_, {"model.", bad}, remove_);
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << QuoteBytes(bad);
    EXPECT_THAT(r.status().message(), HasSubstr(QuoteBytes(bad)));
    EXPECT_THAT(r.status().message(), HasSubstr("not valid UTF-8"));
    remove_.dry_run = true;
    EXPECT_EQ(RemoveKeys(path_, {bad}, remove_).status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(Names(), names);
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path_, storage_));
  EXPECT_NE(m.FindTensor("model.w"), nullptr);
}

// Moves the committed checkpoint of `dir` to commit number `seq` (the manifest says its own
// number, so it is re-encoded), and drops the hint.
void MoveCommitTo(MemoryStorage& storage, const std::string& dir, uint64_t seq) {
  const std::string from = testing::CommitPath(storage, dir);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, storage.GetFileContents(from));
  ASSERT_OK_AND_ASSIGN(Metadata m, DecodeManifest(bytes, from));
  m.commit_seq = seq;
  ASSERT_OK(storage.Remove(from));
  storage.Remove(dir + "/" + kSequenceHintFileName).IgnoreError();
  storage.SetFileContents(dir + "/" + CommitName(seq), EncodeManifest(m));
}

constexpr uint64_t kLastCommit = std::numeric_limits<uint64_t>::max();

TEST_F(RemoveKeysTest, AtTheLastCommitNumberNothingMoreIsCommittedAndTheErrorSaysWhy) {
  TrainState state(8, 100);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  MoveCommitTo(*storage_, path_, kLastCommit);
  const std::vector<std::string> names = Names();
  for (bool dry_run : {false, true}) {
    remove_.dry_run = dry_run;
    Result<RemoveKeysReport> r = RemoveKeys(path_, {"optimizer."}, remove_);
    ASSERT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << dry_run;
    EXPECT_THAT(r.status().message(), HasSubstr(path_));
    EXPECT_THAT(r.status().message(), HasSubstr("18446744073709551615"));
  }
  // A save into the directory is refused the same way; what is there still loads.
  const Status saved = Save(state.Dict(), path_, save_).status();
  ASSERT_EQ(saved.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(saved.message(), HasSubstr("18446744073709551615"));
  EXPECT_EQ(Names(), names);
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path_, storage_));
  EXPECT_EQ(m.commit_seq, kLastCommit);
  EXPECT_NE(m.FindTensor("optimizer.m.w"), nullptr);
}

TEST_F(RemoveKeysTest, OneBelowTheLastCommitNumberARemovalTakesTheLastAndItsCleanupEnds) {
  TrainState state(9, 100);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  MoveCommitTo(*storage_, path_, kLastCommit - 1);
  // Before: the cleanup's loop `seq <= top` over the numbers up to 2^64 - 1 never ended.
  ASSERT_OK_AND_ASSIGN(RemoveKeysReport r, RemoveKeys(path_, {"optimizer."}, remove_));
  EXPECT_EQ(r.removed_tensors.size(), 2u);
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata(path_, storage_));
  EXPECT_EQ(m.commit_seq, kLastCommit);
  ExpectModelOnly(state);
  ExpectNoStrayFiles();
  Result<RemoveKeysReport> again = RemoveKeys(path_, {"model.b"}, remove_);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
}

// Flips one byte of `key`'s chunk 0 at `at` bytes into it.
void FlipByte(MemoryStorage& storage, const std::string& dir, const std::string& key, uint64_t at) {
  Result<Metadata> m = ReadMetadata(dir, std::shared_ptr<Storage>(&storage, [](Storage*) {}));
  ASSERT_OK(m);
  const ByteLocation& where = m->FindTensor(key)->chunks[0].location;
  const std::string file = dir + "/" + m->files[where.file_index].name;
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, storage.GetFileContents(file));
  bytes[where.offset + at] ^= 0x20;
  storage.SetFileContents(file, bytes);
}

TEST_F(RemoveKeysTest, ACorruptKeptChunkFailsTheCopyNamingItsBlockAndChangesNothing) {
  TrainState state(7);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  FlipByte(*storage_, path_, "model.w", 600 * 1024);  // in the third 256 KiB block
  const std::vector<std::string> names = Names();
  ASSERT_OK_AND_ASSIGN(Metadata before, ReadMetadata(path_, storage_));
  Result<RemoveKeysReport> r = RemoveKeys(path_, {"optimizer."}, remove_);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
  EXPECT_THAT(r.status().message(), HasSubstr("checksum mismatch in key 'model.w' chunk 0"));
  EXPECT_THAT(r.status().message(), HasSubstr("block of bytes [524288, 786432)"));
  EXPECT_THAT(r.status().message(), HasSubstr(before.files[0].name));
  EXPECT_THAT(r.status().message(), HasSubstr("nothing was removed"));
  EXPECT_EQ(Names(), names);  // no new file, no marker left behind
  ASSERT_OK_AND_ASSIGN(Metadata after, ReadMetadata(path_, storage_));
  EXPECT_EQ(after, before);
}

TEST_F(RemoveKeysTest, ReportsProgressFromTheCallingThreadUpToTheBytesCopied) {
  TrainState state(8);
  ASSERT_OK(Save(state.Dict(), path_, save_));
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  bool other_thread = false;
  const std::thread::id me = std::this_thread::get_id();
  remove_.progress = [&](uint64_t done, uint64_t total) {
    other_thread |= std::this_thread::get_id() != me;
    calls.emplace_back(done, total);
  };
  ASSERT_OK_AND_ASSIGN(RemoveKeysReport r, RemoveKeys(path_, {"optimizer."}, remove_));
  ASSERT_FALSE(calls.empty());
  EXPECT_FALSE(other_thread);
  EXPECT_EQ(calls.back(), std::make_pair(r.bytes_copied, r.bytes_copied));
  for (size_t i = 1; i < calls.size(); ++i) {
    EXPECT_LE(calls[i - 1].first, calls[i].first);
    EXPECT_EQ(calls[i].second, r.bytes_copied);
  }
}

// Runs `hook` once, when the first data file is created through it: a save that commits while
// RemoveKeys copies.
class HookStorage : public StorageWrapper {
 public:
  HookStorage(std::shared_ptr<Storage> base, std::function<void()> hook)
      : StorageWrapper(std::move(base)), hook_(std::move(hook)) {}
  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        CreateMode mode) override {
    if (hook_ && path.ends_with(".safetensors")) std::exchange(hook_, nullptr)();
    return target().NewWritableFile(path, mode);
  }

 private:
  std::function<void()> hook_;
};

TEST_F(RemoveKeysTest, ASaveThatCommitsMeanwhileWinsAndNothingIsRemoved) {
  TrainState old_state(9, 1000), new_state(10, 1000);
  ASSERT_OK(Save(old_state.Dict(), path_, save_));
  Status interloper;
  remove_.storage = std::make_shared<HookStorage>(
      storage_, [&] { interloper = Save(new_state.Dict(), path_, save_).status(); });
  Result<RemoveKeysReport> r = RemoveKeys(path_, {"optimizer."}, remove_);
  ASSERT_OK(interloper);
  EXPECT_EQ(r.status().code(), StatusCode::kAborted) << r.status().ToString();
  EXPECT_THAT(r.status().message(), HasSubstr("changed while keys were being removed"));
  // The newer save is the checkpoint, whole.
  TrainState got(0, 1000);
  StateDict dict = got.Dict();
  LoadOptions o;
  o.storage = storage_;
  ASSERT_OK(Load(dict, path_, o));
  EXPECT_EQ(got.m_w, new_state.m_w);
  ASSERT_OK(Verify(path_, storage_));
}

}  // namespace
}  // namespace tessera
