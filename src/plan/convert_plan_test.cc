// Conversion planning: selection, renaming, dtypes, files, ranks and units.
#include "plan/convert_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TensorInfo Tensor(const std::string& key, DType dtype, Shape shape) {
  TensorInfo t;
  t.key = key;
  t.dtype = dtype;
  t.global_shape = std::move(shape);
  return t;
}

ObjectInfo Object(const std::string& key, uint64_t bytes) {
  ObjectInfo o;
  o.key = key;
  o.location.length = bytes;
  return o;
}

// Sorted by key, as Metadata is.
Metadata Source() {
  Metadata m;
  m.tensors = {Tensor("model.a", DType::kF32, {4, 4}), Tensor("model.b", DType::kI32, {10}),
               Tensor("model.c", DType::kF64, {3}), Tensor("model.d", DType::kF8E4M3, {16}),
               Tensor("opt.x", DType::kF32, {8})};
  m.objects = {Object("model.o", 5), Object("step", 3)};
  return m;
}

std::vector<std::string> TensorNames(const ConvertPlan& plan) {
  std::vector<std::string> names;
  for (const OutputTensor& t : plan.tensors) names.push_back(t.name);
  return names;
}

TEST(ConvertPlanTest, SelectsRenamesAndSkipsObjectsTheTargetCannotHold) {
  ConvertPlanOptions options;
  options.key_prefixes = {"model.", "step"};
  options.strip_prefix = "model.";
  ASSERT_OK_AND_ASSIGN(ConvertPlan plan, PlanConversion(Source(), options));
  EXPECT_THAT(TensorNames(plan), ElementsAre("a", "b", "c", "d"));
  EXPECT_THAT(plan.skipped_objects, ElementsAre("model.o", "step"));
  EXPECT_TRUE(plan.objects.empty());
  EXPECT_EQ(plan.total_tensor_bytes, 64u + 40u + 24u + 16u);
  EXPECT_EQ(plan.tensors[0].source, 0u);

  options.keep_objects = true;
  ASSERT_OK_AND_ASSIGN(plan, PlanConversion(Source(), options));
  ASSERT_EQ(plan.objects.size(), 2u);
  EXPECT_EQ(plan.objects[0].name, "o");
  EXPECT_EQ(plan.objects[1].name, "step");
  EXPECT_TRUE(plan.skipped_objects.empty());
  // Objects follow the tensors in the last file.
  const OutputFile& file = plan.files.back();
  EXPECT_THAT(file.objects, ElementsAre(0, 1));
  EXPECT_EQ(plan.objects[0].offset, 144u);
  EXPECT_EQ(file.data_bytes, 144u + 5u + 3u);
}

TEST(ConvertPlanTest, OneItemPerFileGivesEveryTensorAndObjectAFileOfItsOwn) {
  Metadata source = Source();
  source.tensors.insert(source.tensors.begin() + 4, Tensor("model.empty", DType::kF32, {0}));
  ConvertPlanOptions options;
  options.keep_objects = true;
  options.one_item_per_file = true;
  options.num_ranks = 2;
  ASSERT_OK_AND_ASSIGN(ConvertPlan plan, PlanConversion(source, options));
  ASSERT_EQ(plan.files.size(), 8u);  // an empty tensor too
  for (uint32_t i = 0; i < plan.tensors.size(); ++i) {
    EXPECT_THAT(plan.files[i].tensors, ElementsAre(i));
    EXPECT_TRUE(plan.files[i].objects.empty());
    EXPECT_EQ(plan.tensors[i].file, i);
    EXPECT_EQ(plan.tensors[i].offset, 0u);
  }
  EXPECT_THAT(plan.files[6].objects, ElementsAre(0));
  EXPECT_THAT(plan.files[7].objects, ElementsAre(1));
  EXPECT_EQ(plan.objects[1].offset, 0u);
}

TEST(ConvertPlanTest, OnlyFloatsChangeDtype) {
  ConvertPlanOptions options;
  options.dtype = DType::kBF16;
  ASSERT_OK_AND_ASSIGN(ConvertPlan plan, PlanConversion(Source(), options));
  std::vector<DType> dtypes;
  for (const OutputTensor& t : plan.tensors) dtypes.push_back(t.dtype);
  EXPECT_THAT(dtypes,
              ElementsAre(DType::kBF16, DType::kI32, DType::kBF16, DType::kF8E4M3, DType::kBF16));
  EXPECT_EQ(plan.tensors[2].bytes, 6u);  // 3 F64 -> 3 BF16
  options.dtype = DType::kU8;
  EXPECT_THAT(PlanConversion(Source(), options).status().message(),
              HasSubstr("must be F64, F32, F16 or BF16, not U8"));
}

TEST(ConvertPlanTest, NamesThatCollideOrVanishAreErrorsNamingTheKeys) {
  Metadata m;
  m.tensors = {Tensor("a", DType::kF32, {1}), Tensor("model.a", DType::kF32, {1}),
               Tensor("model.b", DType::kF32, {1})};
  m.objects = {Object("model.b", 1)};
  ConvertPlanOptions options;
  options.strip_prefix = "model.";
  EXPECT_THAT(PlanConversion(m, options).status().message(),
              HasSubstr("keys 'a' and 'model.a' both become 'a' once 'model.' is stripped"));
  m.tensors.erase(m.tensors.begin());
  options.keep_objects = true;
  EXPECT_THAT(PlanConversion(m, options).status().message(),
              HasSubstr("tensor 'model.b' and object 'model.b' both become 'b'"));
  m.objects.clear();
  m.tensors.push_back(Tensor("model.", DType::kF32, {1}));
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.key < b.key; });
  EXPECT_THAT(PlanConversion(m, options).status().message(),
              HasSubstr("key 'model.' becomes empty once 'model.' is stripped"));
}

TEST(ConvertPlanTest, FilesHoldAtMostTheLimitUnlessOneTensorIsLarger) {
  Metadata m;
  m.tensors = {Tensor("a", DType::kU8, {40}), Tensor("b", DType::kU8, {70}),
               Tensor("c", DType::kU8, {0}),  Tensor("d", DType::kU8, {250}),
               Tensor("e", DType::kU8, {10}), Tensor("f", DType::kU8, {20})};
  ConvertPlanOptions options;
  options.max_file_bytes = 100;
  options.num_ranks = 2;
  ASSERT_OK_AND_ASSIGN(ConvertPlan plan, PlanConversion(m, options));
  ASSERT_EQ(plan.files.size(), 4u);
  EXPECT_THAT(plan.files[0].tensors, ElementsAre(0));     // a (b would overflow)
  EXPECT_THAT(plan.files[1].tensors, ElementsAre(1, 2));  // b, and c without bytes
  EXPECT_THAT(plan.files[2].tensors, ElementsAre(3));     // d alone, larger than the limit
  EXPECT_THAT(plan.files[3].tensors, ElementsAre(4, 5));
  EXPECT_EQ(plan.tensors[5].offset, 10u);
  // Largest first to the least loaded rank: d (250) -> 0, b (70) -> 1, a (40) -> 1, e+f -> 1.
  EXPECT_EQ(plan.files[2].rank, 0);
  EXPECT_EQ(plan.files[1].rank, 1);
  EXPECT_EQ(plan.files[0].rank, 1);
  EXPECT_EQ(plan.files[3].rank, 1);
}

TEST(ConvertPlanTest, NothingToExportIsAnError) {
  ConvertPlanOptions options;
  options.key_prefixes = {"none."};
  EXPECT_THAT(PlanConversion(Source(), options).status().message(),
              HasSubstr("no key to export starts with any of the prefixes 'none.'"));
  options.key_prefixes = {"step"};
  options.format_name = "safetensors";
  EXPECT_THAT(PlanConversion(Source(), options).status().message(),
              HasSubstr("only objects ('step'), which safetensors files cannot hold"));
}

// Property: for random tensors, dtypes, limits and unit sizes, every rank's units cover the
// bytes of its files' tensors exactly once, in order, back to back; no unit needs more than
// its budget of output or source buffer; a tensor is cut only on block boundaries.
TEST(ConvertPlanTest, UnitsCoverEveryByteOnceWithinTheirBudget) {
  const DType kDtypes[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kI8};
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    Metadata m;
    const int count = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < count; ++i) {
      Shape shape;
      for (int d = static_cast<int>(rng() % 3); d > 0; --d) shape.push_back(rng() % 700);
      char key[16];
      std::snprintf(key, sizeof(key), "t%02d", i);
      m.tensors.push_back(Tensor(key, kDtypes[rng() % 5], shape));
    }
    ConvertPlanOptions options;
    if (rng() % 2) options.dtype = kDtypes[rng() % 4];
    options.max_file_bytes = 1 + rng() % 400000;
    options.num_ranks = 1 + static_cast<int>(rng() % 3);
    ASSERT_OK_AND_ASSIGN(ConvertPlan plan, PlanConversion(m, options));
    const uint64_t block = uint64_t{8} << (rng() % 8);
    const uint64_t unit_bytes = rng() % (40 * block);
    const uint64_t budget = std::max(unit_bytes, 4 * block);
    std::vector<std::vector<bool>> covered(plan.tensors.size());
    for (size_t t = 0; t < plan.tensors.size(); ++t) {
      covered[t].assign(plan.tensors[t].bytes / DTypeSize(plan.tensors[t].dtype), false);
    }
    for (int rank = 0; rank < options.num_ranks; ++rank) {
      uint64_t file = 0, next = 0;  // where the next unit must start
      for (const ConvertUnit& unit : PlanUnits(plan, rank, unit_bytes, block)) {
        ASSERT_EQ(plan.files[unit.file].rank, rank);
        ASSERT_LE(unit.out_bytes, budget);
        ASSERT_LE(unit.src_bytes, budget);
        if (unit.file != file) next = 0;
        file = unit.file;
        // Units follow each other, skipping only tensors without elements.
        ASSERT_GE(unit.offset, next);
        uint64_t at = unit.offset, out = 0, src = 0;
        for (const UnitPiece& p : unit.pieces) {
          const OutputTensor& t = plan.tensors[p.tensor];
          const uint64_t size = DTypeSize(t.dtype);
          ASSERT_EQ(t.file, unit.file);
          ASSERT_EQ(t.offset + p.begin * size, at);
          ASSERT_EQ(p.out_offset, out);
          ASSERT_EQ(p.converted, t.dtype != t.source_dtype);
          if (p.converted) {
            ASSERT_EQ(p.src_offset, src);
          }
          ASSERT_LT(p.begin, p.end);
          if (p.begin != 0) {
            ASSERT_EQ(p.begin * size % block, 0u);
          }
          if (p.end != static_cast<int64_t>(covered[p.tensor].size())) {
            ASSERT_EQ(p.end * size % block, 0u);
          }
          for (int64_t e = p.begin; e < p.end; ++e) {
            ASSERT_FALSE(covered[p.tensor][e]);
            covered[p.tensor][e] = true;
          }
          at += (p.end - p.begin) * size;
          out += (p.end - p.begin) * size;
          if (p.converted) src += (p.end - p.begin) * DTypeSize(t.source_dtype);
        }
        ASSERT_EQ(out, unit.out_bytes);
        ASSERT_EQ(src, unit.src_bytes);
        next = at;
      }
    }
    for (size_t t = 0; t < covered.size(); ++t) {
      for (bool c : covered[t]) ASSERT_TRUE(c) << plan.tensors[t].name;
    }
  }
}

}  // namespace
}  // namespace tessera
