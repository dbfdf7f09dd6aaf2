// Box arithmetic and the validation of caller input (StateDict::Add).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include <cerrno>

#include "core/hex.h"
#include "core/utf8.h"
#include "tessera/box.h"
#include "tessera/state_dict.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// Issue 11, item 8: Box::end and Box::NumElements overflowed (undefined behaviour, found by
// UBSan), so a box at offset INT64_MAX - 1 looked in bounds.
TEST(BoxTest, ArithmeticNeverOverflows) {
  const Box far({kMax - 1}, {4});
  EXPECT_EQ(far.end(0), kMax);  // saturated
  EXPECT_FALSE(far.InBounds({kMax}));
  EXPECT_FALSE(Box({0}, {kMax}).Contains(far));
  EXPECT_TRUE(Box({0}, {kMax}).Contains(Box({kMax - 1}, {1})));
  EXPECT_EQ(Box({0, 0}, {int64_t{1} << 32, int64_t{1} << 32}).NumElements(), kMax);
  EXPECT_EQ(Box({0, 0, 0}, {0, int64_t{1} << 40, int64_t{1} << 40}).NumElements(), 0);
  EXPECT_FALSE(Intersect(far, Box({0}, {kMax - 1})));
  std::optional<Box> common = Intersect(far, Box({kMax - 2}, {2}));
  ASSERT_TRUE(common);
  EXPECT_EQ(*common, Box({kMax - 1}, {1}));
  EXPECT_EQ(RowMajorStrides({0, int64_t{1} << 40, int64_t{1} << 40})[0], kMax);
}

ShardedTensor Tensor(const std::string& key, const void* data, DType dtype, Shape local,
                     Shape global, std::vector<int64_t> offset) {
  return ShardedTensor::Shard(key, TensorView(data, dtype, std::move(local)), std::move(global),
                              std::move(offset));
}

// Issue 11, item 8: caller mistakes must be InvalidArgument (or OutOfRange) at Add time, naming
// the key, not a DataLoss from deep inside a save.
TEST(StateDictTest, CallerMistakesAreRefusedAtAddNamingTheKey) {
  std::vector<uint8_t> bytes(64);
  StateDict state;

  Status s = state.Add(
      ShardedTensor::Whole("rank300", TensorView(bytes.data(), DType::kU8, Shape(300, 1))));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("tensor 'rank300'"));
  EXPECT_THAT(s.message(), HasSubstr("300 dimensions; at most 64"));
  EXPECT_OK(state.Add(
      ShardedTensor::Whole("rank64", TensorView(bytes.data(), DType::kU8, Shape(64, 1)))));

  s = state.Add(
      ShardedTensor::Whole("dtype99", TensorView(bytes.data(), static_cast<DType>(99), Shape{4})));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("tensor 'dtype99': dtype value 99 is not a tessera dtype"));

  // Global tensors whose byte size overflows an int64.
  for (const Shape& global :
       {Shape{int64_t{1} << 62, 4}, Shape{int64_t{1} << 32, int64_t{1} << 32}, Shape{kMax}}) {
    ShardedTensor t = Tensor("huge", bytes.data(), DType::kF32, {2, 2}, global, {0, 0});
    if (global.size() == 1) t = Tensor("huge", bytes.data(), DType::kF32, {4}, global, {0});
    t.partial = true;
    s = state.Add(t);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << ShapeToString(global) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("tensor 'huge': global shape"));
    EXPECT_THAT(s.message(), HasSubstr("too large"));
  }
  // The largest U8 tensor still fits; a box reaching past its end does not.
  ShardedTensor far = Tensor("far", bytes.data(), DType::kU8, {4}, {kMax}, {kMax - 1});
  far.partial = true;
  s = state.Add(far);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("tensor 'far': local box"));
  ShardedTensor last = Tensor("last", bytes.data(), DType::kU8, {1}, {kMax}, {kMax - 1});
  last.partial = true;
  EXPECT_OK(state.Add(last));
  // A data shape whose element count overflows does not match any box.
  s = state.Add(Tensor("data", bytes.data(), DType::kU8, {int64_t{1} << 32, int64_t{1} << 32},
                       {4, 4}, {0, 0}));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("tensor 'data'"));
}

// Issue 11, item 6: keys are UTF-8 text, checked when added (a name JSON and Python can hold).
TEST(StateDictTest, KeysMustBeUtf8) {
  std::vector<uint8_t> bytes(8);
  StateDict state;
  Status s =
      state.Add(ShardedTensor::Whole("w\xff", TensorView(bytes.data(), DType::kU8, Shape{8})));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("tensor key \"w\\xff\" is not valid UTF-8"));
  s = state.Add(ShardedObject{"o\xc3", {1}, {}});  // a truncated sequence
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("object key \"o\\xc3\" is not valid UTF-8"));
  EXPECT_OK(state.Add(
      ShardedTensor::Whole("caf\xc3\xa9", TensorView(bytes.data(), DType::kU8, Shape{8}))));
  EXPECT_OK(state.Add(ShardedObject{"\xe2\x82\xac", {1}, {}}));
}

// Issue 21: a rank may hold several pieces of one tensor under one key (each its own entry, with
// its own memory); they must agree on dtype and global shape. An object's key stays unique.
TEST(StateDictTest, SeveralPiecesOfOneKeyAreEntriesOfTheirOwn) {
  std::vector<float> a(8), b(8), c(4);
  std::vector<int32_t> wrong(8);
  StateDict state;
  EXPECT_OK(state.Add(Tensor("w", a.data(), DType::kF32, {1, 8}, {4, 8}, {0, 0})));
  EXPECT_OK(state.Add(ShardedObject{"step", {1}, {}}));
  EXPECT_OK(state.Add(Tensor("w", b.data(), DType::kF32, {1, 8}, {4, 8}, {2, 0})));
  EXPECT_OK(state.Add(ShardedTensor::FlatShard("w", TensorView(c.data(), DType::kF32, {4}), {4, 8},
                                               {3, 0}, {1, 8}, 2)));
  EXPECT_EQ(state.size(), 4u);
  EXPECT_EQ(state.num_keys(), 2u);
  EXPECT_EQ(state.CountOf("w"), 3u);
  EXPECT_EQ(state.CountOf("step"), 1u);
  EXPECT_EQ(state.CountOf("absent"), 0u);
  EXPECT_EQ(state.IndicesOf("w"), (std::vector<size_t>{0, 2, 3}));
  EXPECT_EQ(state.IndicesOf("step"), (std::vector<size_t>{1}));
  EXPECT_TRUE(state.IndicesOf("absent").empty());
  ASSERT_NE(state.Find("w"), nullptr);
  EXPECT_EQ(std::get<ShardedTensor>(*state.Find("w")).data.data, a.data());  // the first piece

  Status s = state.Add(Tensor("w", wrong.data(), DType::kI32, {1, 8}, {4, 8}, {1, 0}));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(),
              HasSubstr("tensor 'w': this rank holds pieces of it of dtype F32 and I32"));
  s = state.Add(Tensor("w", a.data(), DType::kF32, {1, 8}, {5, 8}, {1, 0}));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("global shape [4, 8] and [5, 8]"));
  s = state.Add(Tensor("step", a.data(), DType::kF32, {8}, {8}, {0}));
  EXPECT_THAT(s.message(), HasSubstr("duplicate key 'step': it names an object already"));
  s = state.Add(ShardedObject{"w", {1}, {}});
  EXPECT_THAT(s.message(), HasSubstr("duplicate key 'w'"));
  s = state.Add(ShardedObject{"step", {1}, {}});
  EXPECT_THAT(s.message(), HasSubstr("duplicate key 'step'"));
  EXPECT_EQ(state.size(), 4u);  // nothing refused was added
  EXPECT_EQ(state.CountOf("w"), 3u);
}

// Issue 22, defect 10: what puts text from a checkpoint into a one-line message.
TEST(Utf8Test, EscapeControlCharactersKeepsTextAndEscapesControls) {
  EXPECT_EQ(EscapeControlCharacters("layer.0.w\xc3\xa9 /a/b"), "layer.0.w\xc3\xa9 /a/b");
  EXPECT_EQ(EscapeControlCharacters("k\x1b]0;pwned\x07\x1b[2J"), "k\\x1b]0;pwned\\x07\\x1b[2J");
  EXPECT_EQ(EscapeControlCharacters("a\nb\tc\x7f"), "a\\x0ab\\x09c\\x7f");
  EXPECT_EQ(EscapeControlCharacters("csi\xc2\x9b"), "csi\\xc2\\x9b");  // U+009B, a C1 control
  EXPECT_EQ(EscapeControlCharacters("bad\xff\xc3"), "bad\\xff\\xc3");  // not UTF-8
  const std::string once = EscapeControlCharacters("x\x1by\xfe");
  EXPECT_EQ(EscapeControlCharacters(once), once);
}

TEST(Utf8Test, ReplaceInvalidUtf8) {
  EXPECT_EQ(ReplaceInvalidUtf8("caf\xc3\xa9"), "caf\xc3\xa9");
  EXPECT_EQ(ReplaceInvalidUtf8("ckpt-\xff\xfe"), "ckpt-\xef\xbf\xbd\xef\xbf\xbd");
  EXPECT_EQ(ReplaceInvalidUtf8("\xed\xa0\x80"),
            "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");  // surrogate
  EXPECT_TRUE(IsValidUtf8(ReplaceInvalidUtf8("\xc3")));
}

TEST(HexTest, BytesAByteAnd64Bits) {
  const uint8_t bytes[] = {0xab, 0x01, 0x00, 0xff};
  EXPECT_EQ(HexEncode(bytes), "ab0100ff");
  EXPECT_EQ(HexEncode({}), "");
  EXPECT_EQ(HexByte(0x0a), "0a");
  EXPECT_EQ(Hex64(0), "0000000000000000");
  EXPECT_EQ(Hex64(0x0123456789abcdefull), "0123456789abcdef");
  EXPECT_EQ(Hex64(UINT64_MAX), "ffffffffffffffff");
}

TEST(StatusTest, FromErrnoMapsTheCodesStoragesBranchOn) {
  EXPECT_EQ(StatusFromErrno("open /x", ENOENT).code(), StatusCode::kNotFound);
  EXPECT_EQ(StatusFromErrno("create /x", EEXIST).code(), StatusCode::kAlreadyExists);
  const Status full = StatusFromErrno("write /x", ENOSPC);
  EXPECT_EQ(full.code(), StatusCode::kIOError);
  EXPECT_THAT(full.message(), ::testing::StartsWith("write /x: "));
}

TEST(StatusTest, DetailTravelsWithContextAndBadOptionNamesTheOption) {
  Status plain = NotFound("no key 'a'");
  EXPECT_EQ(plain.detail(), nullptr);
  Status with = plain.WithDetail({.kind = StatusDetail::Kind::kMissingKeys, .keys = {"a"}});
  ASSERT_NE(with.detail(), nullptr);
  EXPECT_EQ(with.message(), plain.message());
  Status outer = with.WithContext("loading /c");
  EXPECT_EQ(outer.message(), "loading /c: no key 'a'");
  ASSERT_NE(outer.detail(), nullptr);
  EXPECT_EQ(outer.detail()->kind, StatusDetail::Kind::kMissingKeys);
  EXPECT_EQ(outer.detail()->keys, std::vector<std::string>{"a"});
  EXPECT_EQ(Status::Ok().WithDetail({.keys = {"a"}}).detail(), nullptr);  // OK stays OK

  Status option = BadOption("LoadOptions::num_io_threads", "must be at least 1, got 0");
  EXPECT_EQ(option.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(option.message(), "LoadOptions::num_io_threads must be at least 1, got 0");
  ASSERT_NE(option.detail(), nullptr);
  EXPECT_EQ(option.detail()->kind, StatusDetail::Kind::kBadOption);
  EXPECT_EQ(option.detail()->options, std::vector<std::string>{"LoadOptions::num_io_threads"});
}

}  // namespace
}  // namespace tessera
