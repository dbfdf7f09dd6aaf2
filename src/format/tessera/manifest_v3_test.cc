// Tests of manifest format version 3 (docs/FORMAT.md, section 3.6): the commit sequence number
// and the reference to a rank-local save; versions 1 and 2 still read.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "core/checksum.h"
#include "format/tessera/manifest.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr char kSource[] = "/ckpt/tessera.manifest.00000000000000000007";

Metadata Whole() {
  Metadata m;
  m.checksum_block_bytes = 4096;
  m.save_id = "0123456789abcdef";
  m.num_ranks = 2;
  m.save_time_unix_ms = 1795000000123;
  m.commit_seq = 7;
  m.files = {{"tsr-0123456789abcdef-r00000-f000.safetensors", 4096 + 24}};
  TensorInfo t{"w", DType::kF32, {2, 3}, {}};
  ChunkInfo c;
  c.box = Box({0, 0}, {2, 3});
  c.location = {0, 4096, 24, 5};
  t.chunks.push_back(c);
  m.tensors.push_back(t);
  return m;
}

Metadata Reference() {
  Metadata m;
  m.save_id = "76033e85f0acf92d";
  m.num_ranks = 4;
  m.commit_seq = 12;
  m.rank_local_reference = true;
  return m;
}

// Recomputes body_length and the checksum of a manifest whose last 8 bytes are its checksum.
Bytes Reseal(Bytes bytes) {
  bytes.resize(bytes.size() - 8);
  const uint64_t body = bytes.size() - 24;
  std::memcpy(bytes.data() + 16, &body, 8);
  const uint64_t sum = Checksum(bytes.data(), bytes.size());
  bytes.resize(bytes.size() + 8);
  std::memcpy(bytes.data() + bytes.size() - 8, &sum, 8);
  return bytes;
}

TEST(ManifestV3Test, WholeManifestRoundTripsWithItsCommitNumber) {
  const Metadata m = Whole();
  const Bytes bytes = EncodeManifest(m);
  EXPECT_EQ(bytes[8], 3);
  ASSERT_OK_AND_ASSIGN(Metadata decoded, DecodeManifest(bytes, kSource));
  Metadata want = m;
  want.format_version = 3;
  EXPECT_EQ(decoded, want);
  // The number follows the manifest kind: version 2's body with one varint more.
  const Bytes v2 = EncodeManifestVersion2(m);
  EXPECT_EQ(v2[8], 2);
  EXPECT_EQ(bytes.size(), v2.size() + 1);
  // Body: source format, checksum kind, block size 4096 (varint 80 20), kind, commit number.
  EXPECT_EQ(bytes[24 + 4], 0);  // kind: whole
  EXPECT_EQ(bytes[24 + 5], 7);  // commit 7
  ASSERT_OK_AND_ASSIGN(Metadata old, DecodeManifest(v2, kSource));
  EXPECT_EQ(old.format_version, 2u);
  EXPECT_EQ(old.commit_seq, 0u);
}

// The carried index (between ranks, and CheckAsManifest's check) holds any format id, one a
// test registered too; a stored manifest holds only CheckpointFormat's enumerators.
TEST(ManifestV3Test, TheCarriedIndexHoldsAnyFormatId) {
  Metadata m = Whole();
  m.format = static_cast<CheckpointFormat>(100);
  const Bytes carried = EncodeCarriedIndex(m);
  EXPECT_EQ(carried[0], 100);
  ASSERT_OK_AND_ASSIGN(Metadata decoded, DecodeCarriedIndex(carried, kSource));
  Metadata want = m;
  want.format_version = 3;
  EXPECT_EQ(decoded, want);
  const Bytes stored = EncodeManifest(m);
  EXPECT_THAT(DecodeManifest(stored, kSource).status().message(),
              HasSubstr("unknown source format 100"));
  // What the carried bytes hold after the id is a manifest naming tessera, and every check of
  // one applies.
  ASSERT_OK_AND_ASSIGN(Metadata inner, DecodeManifest(std::span(carried).subspan(1), kSource));
  EXPECT_EQ(inner.format, CheckpointFormat::kTessera);
  Bytes damaged = carried;
  damaged.back() ^= 1;
  EXPECT_EQ(DecodeCarriedIndex(damaged, kSource).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(DecodeCarriedIndex({}, kSource).status().code(), StatusCode::kDataLoss);
}

TEST(ManifestV3Test, ReferenceRoundTripsAndHoldsNothingElse) {
  const Bytes bytes = EncodeManifest(Reference());
  EXPECT_LT(bytes.size(), 64u);
  ASSERT_OK_AND_ASSIGN(Metadata decoded, DecodeManifest(bytes, kSource));
  EXPECT_TRUE(decoded.rank_local_reference);
  EXPECT_EQ(decoded.save_id, "76033e85f0acf92d");
  EXPECT_EQ(decoded.num_ranks, 4);
  EXPECT_EQ(decoded.commit_seq, 12u);
  EXPECT_EQ(decoded.part_rank, -1);
  // A reference that lists files, or names no rank, is refused.
  Metadata with_file = Reference();
  with_file.files = {{"x", 1}};
  Status s = DecodeManifest(EncodeManifest(with_file), kSource).status();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("reference to a rank-local save"));
  Metadata no_ranks = Reference();
  no_ranks.num_ranks = 0;
  EXPECT_EQ(DecodeManifest(EncodeManifest(no_ranks), kSource).status().code(),
            StatusCode::kDataLoss);
}

// Kind 2 is unknown to version 2: a version 2 body that says it is refused.
TEST(ManifestV3Test, KindTwoInAVersionTwoManifestIsCorrupt) {
  Bytes v2 = EncodeManifestVersion2(Whole());
  v2[24 + 4] = 2;
  Status s = DecodeManifest(Reseal(v2), kSource).status();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("unknown manifest kind 2 (format version 2)"));
}

// Every truncation of a version 3 manifest is an error, never a crash; a rank part keeps its
// rank and takes no commit number from the writer beyond what it says.
TEST(ManifestV3Test, EveryTruncationIsAnErrorAndPartsRoundTrip) {
  const Bytes good = EncodeManifest(Reference());
  for (size_t body = 0; body + 32 < good.size(); ++body) {
    Bytes b(good.begin(), good.begin() + 24 + body);
    b.resize(b.size() + 8);
    EXPECT_EQ(DecodeManifest(Reseal(b), kSource).status().code(), StatusCode::kDataLoss) << body;
  }
  Metadata part = Whole();
  part.commit_seq = 0;
  part.part_rank = 1;
  ASSERT_OK_AND_ASSIGN(Metadata decoded, DecodeManifest(EncodeManifest(part), kSource));
  EXPECT_EQ(decoded.part_rank, 1);
  EXPECT_EQ(decoded.commit_seq, 0u);
  EXPECT_FALSE(decoded.rank_local_reference);
}

// The manifest fuzz target's seeds (fuzz/corpus/manifest/, one mode byte then a manifest) cover
// version 3: a whole commit, a reference, and the 68-byte part claiming 2^31-1 ranks (issue 22,
// defect 8).
TEST(ManifestV3Test, FuzzCorpusHasVersion3Seeds) {
  const std::string dir = std::string(TESSERA_SOURCE_DIR) + "/fuzz/corpus/manifest/";
  for (const char* name : {"v3_whole_commit_3", "v3_whole_commit_3_repair", "v3_reference",
                           "v3_reference_repair", "v3_part_claims_2147483647_ranks"}) {
    SCOPED_TRACE(name);
    std::ifstream in(dir + name, std::ios::binary);
    ASSERT_TRUE(in) << "missing seed " << dir << name;
    Bytes seed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GT(seed.size(), 1u);
    ASSERT_OK_AND_ASSIGN(Metadata m, DecodeManifest(Bytes(seed.begin() + 1, seed.end()), name));
    EXPECT_EQ(m.format_version, 3u);
    if (std::string(name).starts_with("v3_reference")) {
      EXPECT_TRUE(m.rank_local_reference);
    }
    if (std::string(name).starts_with("v3_whole")) {
      EXPECT_EQ(m.commit_seq, 3u);
    }
    if (std::string(name).starts_with("v3_part")) {
      EXPECT_EQ(m.num_ranks, 2147483647);
    }
  }
}

}  // namespace
}  // namespace tessera
