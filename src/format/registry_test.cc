#include "format/registry.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "format/checkpoint_index.h"
#include "format/tessera/names.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/memory_storage.h"

namespace tessera {
namespace {

// A save id as NewSaveId draws them (16 lowercase hex digits).
constexpr char kSaveId[] = "00ab00ab00ab00ab";

TEST(RegistryTest, EveryFormatValueIsRegisteredOnceUnderItsName) {
  std::set<std::string> names;
  for (CheckpointFormat id :
       {CheckpointFormat::kTessera, CheckpointFormat::kTorchDist, CheckpointFormat::kSafetensors}) {
    const Format& format = FormatOf(id);
    EXPECT_EQ(format.id(), id);
    EXPECT_EQ(FindFormat(format.name()), &format);
    names.insert(format.name());
  }
  EXPECT_EQ(names.size(), RegisteredFormats().size());
  EXPECT_EQ(FindFormat("zarr"), nullptr);
  EXPECT_EQ(FindFormat(static_cast<CheckpointFormat>(9)), nullptr);
  EXPECT_EQ(FormatNames(), "tessera, torch_dist, safetensors");
}

// Numbered commits are the tessera manifest's protocol (FormatWriter::NumberedCommits): no other
// format's writer, of a save or of a conversion, may declare them, and tessera's names its
// commits as sequence.h and the cleanup find them.
TEST(RegistryTest, OnlyTesseraCommitsByNumber) {
  int numbered = 0;
  for (const Format* format : RegisteredFormats()) {
    std::vector<std::unique_ptr<FormatWriter>> writers;
    if (format->CanWrite()) {
      SaveOptions options;
      options.format = format->id();
      Result<std::unique_ptr<FormatWriter>> writer = format->NewWriter(options, true);
      ASSERT_TRUE(writer.ok()) << format->name() << ": " << writer.status().ToString();
      writers.push_back(std::move(*writer));
    }
    if (format->CanConvertInto()) {
      ConvertOptions options;
      options.to = format->id();
      Result<std::unique_ptr<FormatWriter>> writer = format->NewConversionWriter(options);
      ASSERT_TRUE(writer.ok()) << format->name() << ": " << writer.status().ToString();
      writers.push_back(std::move(*writer));
    }
    for (const std::unique_ptr<FormatWriter>& writer : writers) {
      if (!writer->NumberedCommits()) continue;
      ++numbered;
      EXPECT_EQ(format->id(), CheckpointFormat::kTessera) << format->name();
      for (uint64_t seq : {uint64_t{1}, uint64_t{12}, ~uint64_t{0}}) {
        EXPECT_EQ(writer->IndexFileName(seq), NumberedManifestName(seq)) << format->name();
      }
    }
  }
  EXPECT_EQ(numbered, 2);  // tessera's save and conversion writers
}

// The names of one directory, sorted as ListDir's callers sort them.
std::vector<std::string> Sorted(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  return names;
}

TEST(RegistryTest, ACommitDecides) {
  const FormatChoice tessera =
      ChooseFormats(Sorted({NumberedManifestName(3), DataFileName(kSaveId, 0, 0)}));
  ASSERT_EQ(tessera.committed.size(), 1u);
  EXPECT_EQ(tessera.primary()->id(), CheckpointFormat::kTessera);
  EXPECT_EQ(tessera.primary_claim(), DirectoryClaim::kCommitted);

  const FormatChoice dcp = ChooseFormats(Sorted({".metadata", "__0_0.distcp"}));
  ASSERT_EQ(dcp.committed.size(), 1u);
  EXPECT_EQ(dcp.primary()->id(), CheckpointFormat::kTorchDist);
}

TEST(RegistryTest, RankManifestsBesideADcpCheckpointLetItReadNext) {
  const FormatChoice choice =
      ChooseFormats(Sorted({RankManifestName(kSaveId, 1), ".metadata", "__0_0.distcp"}));
  ASSERT_EQ(choice.committed.size(), 2u);
  EXPECT_EQ(choice.committed[0]->id(), CheckpointFormat::kTessera);
  EXPECT_EQ(choice.committed[1]->id(), CheckpointFormat::kTorchDist);
}

TEST(RegistryTest, UnfinishedSaveIsNotAnotherFormatsData) {
  // A tessera save that died left a data file (a .safetensors file) beside a model file.
  const FormatChoice choice =
      ChooseFormats(Sorted({DataFileName(kSaveId, 0, 0), "model.safetensors"}));
  EXPECT_TRUE(choice.committed.empty());
  ASSERT_NE(choice.unfinished, nullptr);
  EXPECT_EQ(choice.unfinished->id(), CheckpointFormat::kTessera);
  EXPECT_EQ(choice.data, nullptr);
  EXPECT_EQ(choice.primary(), choice.unfinished);
  EXPECT_EQ(choice.primary_claim(), DirectoryClaim::kUnfinished);

  const FormatChoice dcp = ChooseFormats({"__0_0.distcp"});  // no .metadata yet
  ASSERT_NE(dcp.unfinished, nullptr);
  EXPECT_EQ(dcp.unfinished->id(), CheckpointFormat::kTorchDist);
}

TEST(RegistryTest, DataFilesAloneAreAHuggingFaceCheckpoint) {
  const FormatChoice choice =
      ChooseFormats(Sorted({"config.json", "model-00001-of-00002.safetensors",
                            "model-00002-of-00002.safetensors", "model.safetensors.index.json"}));
  ASSERT_NE(choice.data, nullptr);
  EXPECT_EQ(choice.primary()->id(), CheckpointFormat::kSafetensors);
  EXPECT_TRUE(choice.primary()->NestsCheckpoints());
  EXPECT_EQ(choice.primary_claim(), DirectoryClaim::kData);
}

TEST(RegistryTest, NoFormatClaimsOtherFiles) {
  EXPECT_EQ(ChooseFormats({}).primary(), nullptr);
  EXPECT_EQ(ChooseFormats({}).primary_claim(), DirectoryClaim::kNone);
  EXPECT_EQ(ChooseFormats(Sorted({"README.md", "config.json", "tessera.latest"})).primary(),
            nullptr);
}

TEST(RegistryTest, OnlyASafetensorsFileIsACheckpointByItself) {
  ASSERT_NE(FormatOfFile("model.safetensors"), nullptr);
  EXPECT_EQ(FormatOfFile("model.safetensors")->id(), CheckpointFormat::kSafetensors);
  EXPECT_EQ(FormatOfFile(".metadata"), nullptr);
  EXPECT_EQ(FormatOfFile(NumberedManifestName(1)), nullptr);
}

TEST(RegistryTest, CountedFilesAreTheFormatsOwn) {
  const Format& tessera = FormatOf(CheckpointFormat::kTessera);
  EXPECT_TRUE(tessera.CountsFile(NumberedManifestName(2), DirectoryClaim::kCommitted));
  EXPECT_TRUE(tessera.CountsFile(DataFileName(kSaveId, 3, 1), DirectoryClaim::kUnfinished));
  EXPECT_FALSE(tessera.CountsFile("notes.txt", DirectoryClaim::kCommitted));
  const Format& dcp = FormatOf(CheckpointFormat::kTorchDist);
  EXPECT_TRUE(dcp.CountsFile("common.pt", DirectoryClaim::kCommitted));  // Megatron's
  EXPECT_FALSE(dcp.CountsFile("common.pt", DirectoryClaim::kUnfinished));
  EXPECT_TRUE(dcp.CountsFile("__1_0.distcp", DirectoryClaim::kUnfinished));
}

// A format only tests register: claims "fake.index", names itself.
class FakeFormat final : public Format {
 public:
  CheckpointFormat id() const override { return static_cast<CheckpointFormat>(100); }
  const char* name() const override { return "fake"; }
  std::string_view commit_description() const override { return "fake.index"; }
  DirectoryClaim Claim(const std::vector<std::string>& names) const override {
    return std::binary_search(names.begin(), names.end(), "fake.index") ? DirectoryClaim::kCommitted
                                                                        : DirectoryClaim::kNone;
  }
  bool CountsFile(std::string_view name, DirectoryClaim) const override {
    return name == "fake.index";
  }
  Result<FormatIndex> ReadIndex(Storage&, const std::string& dir,
                                const std::vector<std::string>&) const override {
    return FailedPrecondition(dir + ": fake");
  }
  bool DataFilesHaveHeaders() const override { return false; }
};

TEST(RegistryTest, ATestFormatIsRegisteredForTheScopeOfItsRegistration) {
  const FakeFormat fake;
  const CheckpointFormat id = fake.id();
  EXPECT_EQ(FindFormat(id), nullptr);
  EXPECT_STREQ(FormatName(id), "unknown");
  {
    const ScopedFormatRegistration registration(fake);
    EXPECT_EQ(FindFormat(id), &fake);
    EXPECT_EQ(FindFormat("fake"), &fake);
    EXPECT_EQ(&FormatOf(id), &fake);
    EXPECT_STREQ(FormatName(id), "fake");
    EXPECT_EQ(RegisteredFormats().back(), &fake);  // last in detection order
    EXPECT_EQ(FormatNames(), "tessera, torch_dist, safetensors, fake");
    const FormatChoice choice = ChooseFormats({"fake.index"});
    ASSERT_EQ(choice.committed.size(), 1u);
    EXPECT_EQ(choice.primary(), &fake);
    // A tessera commit beside it is read first.
    EXPECT_EQ(ChooseFormats(Sorted({"fake.index", NumberedManifestName(1)})).primary()->id(),
              CheckpointFormat::kTessera);
  }
  EXPECT_EQ(FindFormat(id), nullptr);
  EXPECT_EQ(FindFormat("fake"), nullptr);
  EXPECT_EQ(RegisteredFormats().size(), 3u);
  // The enumerators keep their names.
  EXPECT_STREQ(FormatName(CheckpointFormat::kTorchDist), "torch_dist");
  EXPECT_STREQ(CheckpointFormatName(CheckpointFormat::kSafetensors), "safetensors");
}

// A format from outside (a user's, through the public plug-in API) whose reader returns the
// index of one F32 tensor [4] (16 bytes) in a data file of `file_bytes` bytes.
class OneTensorFormat final : public Format {
 public:
  explicit OneTensorFormat(uint64_t file_bytes) : file_bytes_(file_bytes) {}
  CheckpointFormat id() const override { return static_cast<CheckpointFormat>(101); }
  const char* name() const override { return "one_tensor"; }
  std::string_view commit_description() const override { return "one_tensor.index"; }
  DirectoryClaim Claim(const std::vector<std::string>& names) const override {
    return std::find(names.begin(), names.end(), "one_tensor.index") != names.end()
               ? DirectoryClaim::kCommitted
               : DirectoryClaim::kNone;
  }
  bool CountsFile(std::string_view name, DirectoryClaim) const override {
    return name == "one_tensor.index" || name == "one_tensor.bin";
  }
  Result<FormatIndex> ReadIndex(Storage&, const std::string& dir,
                                const std::vector<std::string>&) const override {
    Metadata m;
    m.format = id();
    m.save_id = kSaveId;
    m.num_ranks = 1;
    m.checksum = ChecksumKind::kNone;
    m.files = {FileInfo{"one_tensor.bin", file_bytes_}};
    TensorInfo t;
    t.key = "w";
    t.dtype = DType::kF32;
    t.global_shape = {4};
    t.chunks = {ChunkInfo{.box = Box{{0}, {4}}, .location = ByteLocation{0, 0, 16, 0}}};
    m.tensors = {t};
    return FormatIndex{dir, std::move(m)};
  }
  bool DataFilesHaveHeaders() const override { return false; }

 private:
  uint64_t file_bytes_;
};

// tessera's own codecs validate what they read; an index a format from outside read is held
// to every rule by the engine, so that a codec's mistake (a chunk past the end of its file) is
// an error naming the directory and the format, never a read outside the file.
TEST(RegistryTest, AnIndexAFormatFromOutsideReadIsHeldToEveryRule) {
  MemoryStorage storage;
  storage.SetFileContents("/ck/one_tensor.index", std::vector<uint8_t>{});
  {
    const OneTensorFormat exact(16);
    const ScopedFormatRegistration registration(exact);
    EXPECT_FALSE(IsBuiltInFormat(exact));
    Result<CheckpointIndex> index = ReadCheckpointIndex(storage, "/ck");
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    EXPECT_EQ(index->metadata.format, exact.id());
    EXPECT_EQ(index->metadata.tensors.at(0).chunks.at(0).location.length, 16u);
  }
  const OneTensorFormat careless(8);
  const ScopedFormatRegistration registration(careless);
  Result<CheckpointIndex> index = ReadCheckpointIndex(storage, "/ck");
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("/ck"), std::string::npos) << index.status().ToString();
  EXPECT_NE(index.status().message().find("one_tensor"), std::string::npos)
      << index.status().ToString();
  // What is wrong: the chunk of 16 bytes in a file of 8.
  EXPECT_NE(index.status().message().find("one_tensor.bin"), std::string::npos)
      << index.status().ToString();
  EXPECT_EQ(index.status().code(), StatusCode::kDataLoss) << index.status().ToString();
  for (const Format* format : RegisteredFormats()) {
    EXPECT_EQ(IsBuiltInFormat(*format), format != &careless) << format->name();
  }
}

TEST(RegistryDeathTest, RegisteringAFormatTwiceAborts) {
  const FakeFormat fake;
  const ScopedFormatRegistration registration(fake);
  EXPECT_DEATH(ScopedFormatRegistration again(fake), "already registered");
}

}  // namespace
}  // namespace tessera
