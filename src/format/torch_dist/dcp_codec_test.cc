// Tests of DcpToMetadata (dcp_codec.h) on synthetic .metadata content: the mapping of items,
// the errors naming the file, and Megatron's N-D reformulated tensors checked element by
// element against random shapes, fragment grids and flat ranges (a property test; the seed is
// printed on failure). Loading torch-written checkpoints is tested in
// src/checkpoint/dcp_load_test.cc.
#include "format/torch_dist/dcp_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "format/tessera/manifest.h"
#include "testing/test_util.h"

namespace tessera::torch_dist {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kItem = 4096;           // every synthetic item's length
constexpr uint64_t kMetadataBytes = 1000;  // the size of the .metadata they came from

// A tensor of `size` whose chunks are `boxes` ({offsets, sizes}), each an item of kItem bytes
// in file "f.distcp", one after another.
void AddTensor(DcpMetadata& m, const std::string& fqn, std::vector<int64_t> size,
               const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>& boxes,
               const std::string& dtype = "float32") {
  DcpTensor t;
  t.fqn = fqn;
  t.torch_dtype = dtype;
  t.size = std::move(size);
  for (const auto& [offsets, sizes] : boxes) {
    t.chunks.push_back(DcpChunk{offsets, sizes, m.storage.size()});
    m.storage.push_back(
        DcpStorage{fqn, offsets, std::nullopt, "f.distcp", m.storage.size() * kItem, kItem});
  }
  m.tensors.push_back(std::move(t));
}

std::map<std::string, uint64_t> Sizes(const DcpMetadata& m) {
  return {{"f.distcp", m.storage.size() * kItem}};
}

TEST(DcpToMetadataTest, TensorsAndObjectsBecomeItems) {
  DcpMetadata dcp;
  dcp.flavor = DcpFlavor::kTorch113;
  AddTensor(dcp, "w", {4, 6}, {{{0, 0}, {2, 6}}, {{2, 0}, {2, 6}}});
  dcp.bytes.push_back(DcpBytes{"obj", dcp.storage.size()});
  dcp.storage.push_back(DcpStorage{"obj", std::nullopt, std::nullopt, "g.distcp", 10, 300});
  auto sizes = Sizes(dcp);
  sizes["g.distcp"] = 310;
  ASSERT_OK_AND_ASSIGN(Metadata m, DcpToMetadata(dcp, sizes, "ckpt/.metadata", kMetadataBytes));
  EXPECT_EQ(m.format, CheckpointFormat::kTorchDist);
  EXPECT_EQ(m.checksum, ChecksumKind::kNone);
  EXPECT_EQ(m.user_metadata.at("torch_dist.flavor"), "1.13");
  ASSERT_EQ(m.tensors.size(), 1u);
  ASSERT_EQ(m.tensors[0].chunks.size(), 2u);
  const ChunkInfo& c = m.tensors[0].chunks[1];
  EXPECT_EQ(c.box, Box({2, 0}, {2, 6}));
  EXPECT_EQ(c.encoding, ChunkEncoding::kTorchSaveItem);
  EXPECT_EQ(c.location.offset, kItem);
  EXPECT_EQ(c.location.length, kItem);
  ASSERT_EQ(m.objects.size(), 1u);
  EXPECT_EQ(m.objects[0].encoding, ObjectEncoding::kTorchSave);
  EXPECT_EQ(m.files[m.objects[0].location.file_index].name, "g.distcp");
  EXPECT_EQ(m.objects[0].location.offset, 10u);
  ASSERT_OK(DecodeManifest(EncodeManifest(m), "m").status());
}

TEST(DcpToMetadataTest, ErrorsNameTheFile) {
  DcpMetadata dcp;
  AddTensor(dcp, "w", {4}, {{{0}, {4}}});
  auto sizes = Sizes(dcp);
  sizes["f.distcp"] = kItem - 1;  // truncated
  Result<Metadata> m = DcpToMetadata(dcp, sizes, "ckpt/.metadata", kMetadataBytes);
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(), HasSubstr("f.distcp"));
  EXPECT_THAT(m.status().message(), HasSubstr("key 'w'"));
  m = DcpToMetadata(dcp, {}, "ckpt/.metadata", kMetadataBytes);
  EXPECT_THAT(m.status().message(), HasSubstr("'f.distcp', which is missing"));
  DcpMetadata complex;
  AddTensor(complex, "c", {2}, {{{0}, {2}}}, "complex64");
  m = DcpToMetadata(complex, Sizes(complex), "ckpt/.metadata", kMetadataBytes);
  EXPECT_THAT(m.status().message(), HasSubstr("key 'c'"));
  DcpMetadata small;
  AddTensor(small, "big", {2000}, {{{0}, {2000}}});  // 8000 bytes of elements in 4096
  m = DcpToMetadata(small, Sizes(small), "ckpt/.metadata", kMetadataBytes);
  EXPECT_THAT(m.status().message(), HasSubstr("fewer than its 8000 bytes of elements"));
}

int64_t Product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

// Row-major index of `index` in `shape`.
int64_t Flat(const std::vector<int64_t>& index, const std::vector<int64_t>& shape) {
  int64_t f = 0;
  for (size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + index[d];
  return f;
}

TEST(DcpToMetadataTest, NdReformulatedTensorsMapEveryElementOnce) {
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    auto draw = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    const size_t rank = static_cast<size_t>(draw(1, 4));
    std::vector<int64_t> fragments(rank), local(rank), original(rank);
    for (size_t d = 0; d < rank; ++d) {
      fragments[d] = draw(1, 3);
      local[d] = draw(1, 4);
      original[d] = fragments[d] * local[d];
    }
    const int64_t n = Product(local);
    // Every fragment's flat range [0, n) cut into random pieces: the DCP chunks.
    DcpMetadata dcp;
    std::vector<int64_t> size = fragments;
    size.push_back(n);
    std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes;
    std::vector<int64_t> f(rank, 0);
    for (int64_t k = 0; k < Product(fragments); ++k) {
      for (int64_t start = 0; start < n;) {
        const int64_t len = draw(1, n - start);
        std::vector<int64_t> offsets = f, sizes(rank, 1);
        offsets.push_back(start);
        sizes.push_back(len);
        boxes.push_back({offsets, sizes});
        start += len;
      }
      for (size_t d = rank; d-- > 0;) {
        if (++f[d] < fragments[d]) break;
        f[d] = 0;
      }
    }
    AddTensor(dcp, "w", size, boxes);
    dcp.has_mcore_data = true;
    dcp.mcore_data.push_back(DcpMcoreEntry{"w", original});
    ASSERT_OK_AND_ASSIGN(Metadata m,
                         DcpToMetadata(dcp, Sizes(dcp), "ckpt/.metadata", kMetadataBytes));
    EXPECT_EQ(NdReformulatedKeys(m), std::set<std::string>{"w"});
    ASSERT_EQ(m.tensors.size(), 1u);
    EXPECT_EQ(m.tensors[0].global_shape, original);
    // Every element of every chunk's box is the element of the original tensor that its item
    // holds at payload_offset + its position in the box (row-major).
    std::vector<int> seen(static_cast<size_t>(Product(original)), 0);
    for (const ChunkInfo& c : m.tensors[0].chunks) {
      ASSERT_EQ(c.encoding, ChunkEncoding::kTorchSaveItem);
      ASSERT_EQ(c.payload_offset % 4, 0u);
      const size_t item = c.location.offset / kItem;  // storage entry == DCP chunk
      const std::vector<int64_t>& chunk_offsets = boxes[item].first;
      std::vector<int64_t> index(rank, 0);
      for (int64_t k = 0; k < c.box.NumElements(); ++k) {
        std::vector<int64_t> at(rank), in_fragment(rank), fragment(rank);
        for (size_t d = 0; d < rank; ++d) {
          at[d] = c.box.offsets[d] + index[d];
          fragment[d] = at[d] / local[d];
          in_fragment[d] = at[d] % local[d];
        }
        const int64_t flat = Flat(in_fragment, local);
        for (size_t d = 0; d < rank; ++d) ASSERT_EQ(fragment[d], chunk_offsets[d]);
        ASSERT_EQ(flat, chunk_offsets[rank] + static_cast<int64_t>(c.payload_offset / 4) + k);
        ++seen[static_cast<size_t>(Flat(at, original))];
        for (size_t d = rank; d-- > 0;) {
          if (++index[d] < c.box.sizes[d]) break;
          index[d] = 0;
        }
      }
    }
    for (int count : seen) ASSERT_EQ(count, 1);
    // At most 2N-1 boxes per DCP chunk.
    EXPECT_LE(m.tensors[0].chunks.size(), boxes.size() * (2 * rank - 1));
    ASSERT_OK(DecodeManifest(EncodeManifest(m), "m").status());
  }
}

TEST(DcpToMetadataTest, NdReformulatedShapeMustMatchTheFragments) {
  DcpMetadata dcp;
  AddTensor(dcp, "w", {2, 6}, {{{0, 0}, {1, 6}}, {{1, 0}, {1, 6}}});
  dcp.mcore_data.push_back(DcpMcoreEntry{"w", std::vector<int64_t>{4, 4}});  // 2x4 per fragment
  Result<Metadata> m = DcpToMetadata(dcp, Sizes(dcp), "ckpt/.metadata", kMetadataBytes);
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(), HasSubstr("key 'w' (N-D reformulated from (4, 4))"));
}

// Issue 22, defect 7: an original shape of 30,000 dimensions once recursed 30,000 deep (and
// copied O(N^2) offsets) before anything checked the rank; now refused at once, naming the key
// and the limit.
TEST(DcpToMetadataTest, NdReformulatedShapeOfTooManyDimensionsIsRefusedFirst) {
  constexpr size_t kRank = 30000;
  DcpMetadata dcp;
  std::vector<int64_t> size(kRank, 1), offsets(kRank + 1, 0), sizes(kRank + 1, 1);
  size.push_back(2);  // each fragment's 2 elements; the chunk holds the first
  AddTensor(dcp, "w", size, {{offsets, sizes}});
  dcp.mcore_data.push_back(DcpMcoreEntry{"w", std::vector<int64_t>(kRank, 1)});
  dcp.mcore_data.back().nd_reformulated_orig_global_shape->back() = 2;
  Result<Metadata> m = DcpToMetadata(dcp, Sizes(dcp), "ckpt/.metadata", kMetadataBytes);
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(), HasSubstr("ckpt/.metadata: key 'w'"));
  EXPECT_THAT(m.status().message(), HasSubstr("30000 dimensions, more than the 64"));
}

// Issue 22, defect 7: fragment shapes whose element count overflows int64 (signed overflow,
// caught by UBSan) are refused, naming the key.
TEST(DcpToMetadataTest, NdReformulatedElementCountOverflowIsRefused) {
  const int64_t big = int64_t{1} << 40;
  DcpMetadata dcp;
  AddTensor(dcp, "w", {1, 1, 1, 64}, {{{0, 0, 0, 0}, {1, 1, 1, 64}}});
  dcp.mcore_data.push_back(DcpMcoreEntry{"w", std::vector<int64_t>{big, big, 4}});
  Result<Metadata> m = DcpToMetadata(dcp, Sizes(dcp), "ckpt/.metadata", kMetadataBytes);
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(), HasSubstr("key 'w'"));
  EXPECT_THAT(m.status().message(), HasSubstr("more elements than an int64 holds"));
  // Negative dimensions of the original shape are refused too.
  dcp.mcore_data.back().nd_reformulated_orig_global_shape = std::vector<int64_t>{-1, -1, -64};
  m = DcpToMetadata(dcp, Sizes(dcp), "ckpt/.metadata", kMetadataBytes);
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(), HasSubstr("negative"));
}

// Issue 22, defect 6, downstream: an N-D reformulated chunk of N dimensions becomes up to 2N-1
// boxes of N dimensions each, so the Metadata made from a small .metadata could still be large;
// it is bounded by the same budget (32 times the .metadata's size, plus 16 MiB).
TEST(DcpToMetadataTest, NdReformulatedBoxesAreBoundedByTheMetadataSize) {
  constexpr size_t kRank = 62;  // fragments of 2^62 elements: 2 per dimension
  const int64_t n = int64_t{1} << kRank;
  std::vector<int64_t> size(kRank, 1);
  size.push_back(n);
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes;
  for (int64_t k = 0; k < 1000; ++k) {  // flat ranges [k + 1, n - k - 1): ~120 boxes each
    std::vector<int64_t> offsets(kRank, 0), sizes(kRank, 1);
    offsets.push_back(k + 1);
    sizes.push_back(n - 2 * k - 2);
    boxes.push_back({offsets, sizes});
  }
  DcpMetadata dcp;
  AddTensor(dcp, "w", size, boxes, "int8");
  dcp.mcore_data.push_back(DcpMcoreEntry{"w", std::vector<int64_t>(kRank, 2)});
  auto sizes = Sizes(dcp);
  for (DcpStorage& s : dcp.storage) s.length = kItem;  // not checked against the elements here
  Result<Metadata> m = DcpToMetadata(dcp, sizes, "ckpt/.metadata", kMetadataBytes);
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(), HasSubstr("ckpt/.metadata: key 'w'"));
  EXPECT_THAT(m.status().message(), HasSubstr("takes more than 16809216 bytes of memory"));
  // The same from a .metadata big enough to explain it reads.
  EXPECT_OK(DcpToMetadata(dcp, sizes, "ckpt/.metadata", 8u << 20).status());
}

}  // namespace
}  // namespace tessera::torch_dist
