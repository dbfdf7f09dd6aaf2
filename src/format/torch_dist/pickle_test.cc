// Tests of the restricted pickle reader and writer (pickle.h, pickle_writer.h) and of CRC-32.
#include "format/torch_dist/pickle.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/crc32.h"
#include "format/torch_dist/pickle_writer.h"
#include "format/torch_dist/test_util.h"
#include "format/torch_dist/torch_dtype.h"
#include "testing/test_util.h"

namespace tessera::torch_dist {
namespace {

using testing::FromHex;
using ::testing::HasSubstr;

// A canonical text of a pickle tree, for comparing with what Python pickled:
//   None True 5 bigint(hex) float(1.5) 'str' b'hex' ba'hex' (a, b) [a] {a} {k: v} mod.name
//   R(callable, args) N(cls, args[, kwargs]) P(pid), then [state=...][list=...][dict=...].
// Depth-limited, so a cyclic structure prints "..." where it recurses.
std::string Canon(const PickleValue& v, int depth = 12) {
  if (depth == 0) return "...";
  auto seq = [&](const char* open, const char* close) {
    std::string s = open;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + Canon(v.item(i), depth - 1);
    if (v.is(PickleKind::kTuple) && v.size() == 1) s += ",";
    return s + close;
  };
  switch (v.kind()) {
    case PickleKind::kNone:
      return "None";
    case PickleKind::kBool:
      return *v.AsBool() ? "True" : "False";
    case PickleKind::kInt:
      return std::to_string(*v.AsInt());
    case PickleKind::kBigInt: {
      const std::string_view b = v.BigIntBytes();
      return "bigint(" + testing::Hex(reinterpret_cast<const uint8_t*>(b.data()), b.size()) + ")";
    }
    case PickleKind::kFloat: {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "float(%g)", *v.AsFloat());
      return buf;
    }
    case PickleKind::kStr:
      return "'" + std::string(*v.AsStr()) + "'";
    case PickleKind::kBytes:
    case PickleKind::kByteArray: {
      const std::string_view b = *v.AsBytes();
      return std::string(v.is(PickleKind::kBytes) ? "b'" : "ba'") +
             testing::Hex(reinterpret_cast<const uint8_t*>(b.data()), b.size()) + "'";
    }
    case PickleKind::kTuple:
      return seq("(", ")");
    case PickleKind::kList:
      return seq("[", "]");
    case PickleKind::kSet:
      return seq("{", "}");
    case PickleKind::kDict: {
      std::string s = "{";
      for (size_t i = 0; i < v.size(); ++i) {
        s += (i ? ", " : "") + Canon(v.key(i), depth - 1) + ": " + Canon(v.value(i), depth - 1);
      }
      return s + "}";
    }
    case PickleKind::kGlobal:
      return std::string(v.global_module()) + "." + std::string(v.global_name());
    case PickleKind::kPersId:
      return "P(" + Canon(v.persistent_id(), depth - 1) + ")";
    case PickleKind::kReduce:
    case PickleKind::kNewObj: {
      std::string s = v.is(PickleKind::kReduce) ? "R(" : "N(";
      s += Canon(v.callable(), depth - 1) + ", " + Canon(v.args(), depth - 1);
      if (auto kw = v.kwargs()) s += ", " + Canon(*kw, depth - 1);
      s += ")";
      if (auto st = v.state()) s += "[state=" + Canon(*st, depth - 1) + "]";
      if (auto l = v.list_items()) s += "[list=" + Canon(*l, depth - 1) + "]";
      if (auto d = v.dict_items()) s += "[dict=" + Canon(*d, depth - 1) + "]";
      return s;
    }
  }
  return "?";
}

// The tree owns a copy of the bytes, so a temporary argument is fine.
Result<PickleTree> Parse(std::vector<uint8_t> bytes) {
  return ParsePickle(std::move(bytes), "test.pkl");
}

std::string CanonOf(const std::vector<uint8_t>& bytes) {
  Result<PickleTree> tree = Parse(bytes);
  if (!tree.ok()) return tree.status().ToString();
  return Canon(tree->root());
}

std::vector<uint8_t> Bytes(std::string_view s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// ---- pickles written by CPython 3.11's pickle.dumps -------------------------------------------
// [0, 255, 256, 65535, 65536, -1, 2**31, -2**31 - 1, 2**63 - 1, -2**63, 2**64, -2**70, True,
//  False, None], protocol 4.
constexpr char kInts4[] =
    "80049554000000000000005d94284b004bff4d00014dffff4a000001004affffffff8a0500000080008a05ffff"
    "ff7fff8a08ffffffffffffff7f8a0800000000000000808a090000000000000000018a090000000000000000c0"
    "88894e652e";
// ["", "abc", "é€", "x" * 300, b"", b"\x00\xff", bytearray(b"ba"), 1.5, -0.0] (the 300 x's are
// spliced in by XString below).
std::vector<uint8_t> Strs(int protocol) {
  const std::string x300 = std::string(600, '7').replace(0, 600, 300, 'x');
  std::string xs;
  for (int i = 0; i < 300; ++i) xs += "78";
  if (protocol == 4) {
    return FromHex(
        "80049584010000000000005d94288c00948c03616263948c05c3a9e282ac94582c010000" + xs +
        "94430094430200ff948c086275696c74696e73948c09627974656172726179949394430262619485"
        "945294473ff8000000000000478000000000000000652e");
  }
  if (protocol == 5) {
    return FromHex("8005956e010000000000005d94288c00948c03616263948c05c3a9e282ac94582c010000" + xs +
                   "94430094430200ff94960200000000000000626194473ff8000000000000478000000000000000"
                   "652e");
  }
  return FromHex(
      "80025d71002858000000007101580300000061626371025805000000c3a9e282ac7103582c010000" + xs +
      "7104635f5f6275696c74696e5f5f0a62797465730a710529527106635f636f646563730a656e636f64650a"
      "7107580300000000c3bf710858060000006c6174696e31710986710a52710b635f5f6275696c74696e5f5f0a"
      "6279746561727261790a710c680758020000006261710d680986710e52710f857110527111473ff8000000"
      "000000478000000000000000652e");
}
// {"t0": (), "t1": (1,), "t3": (1, 2, 3), "t5": (1, 2, 3, 4, 5), "l": [1, [2]], "s": {3},
//  "fs": frozenset([4]), "sh": (shared, shared)} with shared = [7], protocol 4.
constexpr char kContainers4[] =
    "80049564000000000000007d94288c02743094298c027431944b0185948c027433944b014b024b0387948c0274"
    "3594284b014b024b034b044b0574948c016c945d94284b015d944b0261658c0173948f94284b03908c02667394"
    "284b0491948c027368945d944b076168108694752e";
// [Obj() (a=1, b="x"), Slots() (s=5), OrderedDict([("k", 1)]), Ex(1, k=2) (__getnewargs_ex__)]
// with classes in module "mod", protocol 4.
constexpr char kObjects4[] =
    "8004958d000000000000005d94288c036d6f64948c034f626a9493942981947d94288c0161944b018c016294"
    "8c017894756268018c05536c6f74739493942981944e7d948c0173944b05738694628c0b636f6c6c65637469"
    "6f6e73948c0b4f726465726564446963749493942952948c016b944b017368018c0245789493944b0185947d"
    "9468134b027392947d948c0176944b017362652e";
// rec = []; rec.append(rec), protocol 4.
constexpr char kRecursive4[] = "80049506000000000000005d946800612e";

TEST(PickleTest, IntsFromCPython) {
  EXPECT_EQ(CanonOf(FromHex(kInts4)),
            "[0, 255, 256, 65535, 65536, -1, 2147483648, -2147483649, 9223372036854775807, "
            "-9223372036854775808, bigint(000000000000000001), bigint(0000000000000000c0), True, "
            "False, None]");
  ASSERT_OK_AND_ASSIGN(PickleTree tree, Parse(FromHex(kInts4)));
  EXPECT_THAT(tree.root().item(10).AsInt().status().message(), HasSubstr("beyond 64 bits"));
  EXPECT_EQ(*tree.root().item(12).AsInt(), 1);  // a bool is an int
  EXPECT_THAT(tree.root().item(0).AsStr().status().message(),
              HasSubstr("expected a str, found int 0"));
}

TEST(PickleTest, StringsAndBytesFromCPython) {
  const std::string x300(300, 'x');
  EXPECT_EQ(CanonOf(Strs(4)), "['', 'abc', 'é€', '" + x300 +
                                  "', b'', b'00ff', R(builtins.bytearray, (b'6261',)), "
                                  "float(1.5), float(-0)]");
  EXPECT_EQ(CanonOf(Strs(5)),
            "['', 'abc', 'é€', '" + x300 + "', b'', b'00ff', ba'6261', float(1.5), float(-0)]");
  // Protocol 2 has no bytes opcodes: bytes are _codecs.encode(latin-1 text), b"" is bytes().
  for (int protocol : {2, 4, 5}) {
    SCOPED_TRACE(protocol);
    const std::vector<uint8_t> bytes = Strs(protocol);
    ASSERT_OK_AND_ASSIGN(PickleTree tree, Parse(bytes));
    EXPECT_EQ(*DecodePickledBytes(tree.root().item(4)), "");
    EXPECT_EQ(*DecodePickledBytes(tree.root().item(5)), std::string("\x00\xff", 2));
    EXPECT_EQ(*DecodePickledBytes(tree.root().item(6)), "ba");
    EXPECT_THAT(DecodePickledBytes(tree.root().item(1)).status().message(),
                HasSubstr("expected a bytes object, found str 'abc'"));
    EXPECT_EQ(tree.end_offset(), bytes.size());
  }
}

TEST(PickleTest, ContainersAndSharedReferences) {
  EXPECT_EQ(CanonOf(FromHex(kContainers4)),
            "{'t0': (), 't1': (1,), 't3': (1, 2, 3), 't5': (1, 2, 3, 4, 5), 'l': [1, [2]], "
            "'s': {3}, 'fs': {4}, 'sh': ([7], [7])}");
  ASSERT_OK_AND_ASSIGN(PickleTree tree, Parse(FromHex(kContainers4)));
  const PickleValue sh = *tree.root().Find("sh");
  EXPECT_EQ(sh.item(0).id(), sh.item(1).id());  // the memo shares the node
  EXPECT_FALSE(tree.root().Find("nope").has_value());
  EXPECT_EQ(tree.root().size(), 8u);
}

TEST(PickleTest, ObjectsAreInertRecords) {
  EXPECT_EQ(CanonOf(FromHex(kObjects4)),
            "[N(mod.Obj, ())[state={'a': 1, 'b': 'x'}], N(mod.Slots, ())[state=(None, {'s': 5})], "
            "R(collections.OrderedDict, ())[dict={'k': 1}], N(mod.Ex, (1,), {'k': 2})"
            "[state={'v': 1}]]");
  ASSERT_OK_AND_ASSIGN(PickleTree tree, Parse(FromHex(kObjects4)));
  const PickleValue root = tree.root();
  EXPECT_TRUE(root.item(0).IsObjectOf("mod", "Obj"));
  EXPECT_EQ(*root.item(0).Attr("b")->AsStr(), "x");
  EXPECT_EQ(*root.item(1).Attr("s")->AsInt(), 5);  // from the slots half of the state
  EXPECT_FALSE(root.item(1).Attr("t").has_value());
  EXPECT_TRUE(root.item(2).IsObjectOf("collections", "OrderedDict"));
  EXPECT_EQ(root.item(0).Describe(), "newobj of global mod.Obj");
}

TEST(PickleTest, CyclesAreSharedNodesNotRecursion) {
  ASSERT_OK_AND_ASSIGN(PickleTree tree, Parse(FromHex(kRecursive4)));
  EXPECT_EQ(tree.root().size(), 1u);
  EXPECT_EQ(tree.root().item(0).id(), tree.root().id());
}

TEST(PickleTest, DeepNestingDoesNotRecurse) {
  // 200000 nested lists: EMPTY_LIST x n, then APPEND x (n - 1).
  const size_t n = 200000;
  std::vector<uint8_t> bytes = {0x80, 0x04};
  bytes.insert(bytes.end(), n, ']');
  bytes.insert(bytes.end(), n - 1, 'a');
  bytes.push_back('.');
  ASSERT_OK_AND_ASSIGN(PickleTree tree, Parse(bytes));
  PickleValue v = tree.root();
  size_t depth = 1;
  while (v.size() == 1) {
    v = v.item(0);
    ++depth;
  }
  EXPECT_EQ(depth, n);
  EXPECT_LE(tree.node_count(), bytes.size() + 300);  // memory linear in the input
}

// Issue 22: memory was about 25 times the input for a stream of 1-byte opcodes that each make a
// container (16-byte nodes, and vectors that doubled: old and new copies at once). Now 9 bytes
// a node in arrays that never move, 4 a child: at most 13 per input byte for the tree.
TEST(PickleTest, MemoryOfTheTreeIsAFewBytesPerInputByte) {
  constexpr size_t kOps = 4u << 20;
  for (uint8_t op : {uint8_t{']'}, uint8_t{'}'}, uint8_t{0x8f} /* EMPTY_SET */}) {
    std::vector<uint8_t> bytes = {0x80, 0x04};
    bytes.insert(bytes.end(), kOps, op);
    bytes.push_back('.');
    ASSERT_OK_AND_ASSIGN(PickleTree tree, ParsePickle(bytes, "lists"));
    EXPECT_EQ(tree.node_count(), kOps + 260);
    EXPECT_LE(tree.memory_bytes(), 10 * bytes.size()) << tree.memory_bytes() / bytes.size();
  }
  // A chain of TUPLE1: a node and a child each.
  std::vector<uint8_t> chain = {0x80, 0x04, ']'};
  chain.insert(chain.end(), kOps, 0x85);
  chain.push_back('.');
  ASSERT_OK_AND_ASSIGN(PickleTree tree, ParsePickle(chain, "tuples"));
  EXPECT_LE(tree.memory_bytes(), 14 * chain.size()) << tree.memory_bytes() / chain.size();
  // The chain reads back: every tuple holds the one before it.
  PickleValue v = tree.root();
  for (size_t i = 0; i < kOps; ++i) {
    ASSERT_TRUE(v.is(PickleKind::kTuple) && v.size() == 1) << i;
    v = v.item(0);
  }
  EXPECT_TRUE(v.is(PickleKind::kList));
}

TEST(PickleTest, TextOpcodesOfProtocolZero) {
  // (I42\nI01\nI00\nF-1.5\nL123456789012L\nN g0... : MARK, INT, bools, FLOAT, LONG, PUT/GET.
  EXPECT_EQ(CanonOf(Bytes("(I42\nI01\nI00\nF-1.5\nL123456789012L\np7\ng7\nt.")),
            "(42, True, False, float(-1.5), 123456789012, 123456789012)");
  EXPECT_EQ(CanonOf(Bytes("(lp0\nI1\na(dp1\nS")).substr(0, 8), "DataLoss");  // STRING refused
  EXPECT_EQ(CanonOf(Bytes("cmod\nname\n(I1\ntR.")), "R(mod.name, (1,))");
  EXPECT_EQ(CanonOf(Bytes("Pabc\n.")), "P('abc')");
}

TEST(PickleTest, MemoWithLargeIndices) {
  // LONG_BINPUT 0x7fffffff then LONG_BINGET of it: kept in the sparse part of the memo.
  const std::vector<uint8_t> bytes = FromHex("80024b0572ffffff7f6affffff7f862e");
  EXPECT_EQ(CanonOf(bytes), "(5, 5)");
}

TEST(PickleTest, WriterMatchesCPython) {
  // PickleWriter(4) of the ints case (without FRAME) is CPython's stream minus the frame header.
  PickleWriter w(4);
  w.EmptyList();
  w.Memoize();
  w.Mark();
  for (int64_t v : {0LL, 255LL, 256LL, 65535LL, 65536LL, -1LL, 2147483648LL, -2147483649LL,
                    9223372036854775807LL, -9223372036854775807LL - 1}) {
    w.Int(v);
  }
  std::vector<uint8_t> expected = FromHex(kInts4);
  expected.erase(expected.begin() + 2, expected.begin() + 11);  // FRAME
  std::vector<uint8_t> got = w.Take();
  ASSERT_LT(got.size(), expected.size());
  EXPECT_EQ(testing::Hex(got.data(), got.size()), testing::Hex(expected.data(), got.size()));
  // Round trip through the reader for integers around every encoding boundary.
  std::mt19937_64 rng(7);
  PickleWriter w2(2);
  w2.Mark();
  std::vector<int64_t> values;
  for (int shift = 0; shift < 64; ++shift) {
    for (uint64_t base : {uint64_t{1} << shift, uint64_t{0} - (uint64_t{1} << shift)}) {
      for (int64_t d : {-1, 0, 1})
        values.push_back(static_cast<int64_t>(base + static_cast<uint64_t>(d)));
    }
  }
  for (int i = 0; i < 200; ++i) values.push_back(static_cast<int64_t>(rng()));
  for (int64_t v : values) w2.Int(v);
  w2.Tuple();
  w2.Stop();
  ASSERT_OK_AND_ASSIGN(PickleTree tree, Parse(w2.bytes()));
  ASSERT_EQ(tree.root().size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(*tree.root().item(i).AsInt(), values[i]);
}

struct BadCase {
  const char* hex;
  const char* message;
};

TEST(PickleTest, ErrorsNameTheOffsetAndOpcode) {
  const BadCase cases[] = {
      {"8004ff", "test.pkl: pickle: unknown opcode at offset 2 (opcode 0xff)"},
      {"80048c05616263",
       "truncated: 5 more bytes needed, 3 left at offset 2 (opcode SHORT_BINUNICODE 0x8c)"},
      {"80044b01", "ends at offset 4 without STOP"},
      {"800252", "stack underflow at offset 2 (opcode REDUCE 0x52)"},
      {"8004680a2e", "memo index 10 was never stored at offset 2 (opcode BINGET 0x68)"},
      {"8005972e", "out-of-band buffers are not supported at offset 2"},
      {"8006", "unsupported pickle protocol 6 at offset 0"},
      {"80047d284b01752e", "odd number of items for a dict at offset 6 (opcode SETITEMS 0x75)"},
      {"80045d7d622e", "BUILD of a list at offset 4"},
      {"8004634d0a4e0a5d522e", "arguments are a list, not a tuple at offset 8 (opcode REDUCE"},
      {"8004634d0a4e0a29817d627d622e", "second BUILD of one object at offset 12"},
      {"8004824b", "the copyreg extension registry is not supported at offset 2"},
      {"80044b01612e", "stack underflow at offset 4 (opcode APPEND 0x61)"},
      {"80042e", "stack underflow at offset 2 (opcode STOP 0x2e)"},
      {"8004952000000000000000",
       "truncated: 32 more bytes needed, 0 left at offset 2 (opcode FRAME"},
      {"80048a09ff", "truncated: 9 more bytes needed, 1 left"},
      {"80048bffffffff", "negative LONG4 length"},
      {"80044b0128852e",
       "stack underflow at offset 5 (opcode TUPLE1"},  // 1 MARK TUPLE1: 1 is below
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.hex);
    Result<PickleTree> tree = Parse(FromHex(c.hex));
    ASSERT_FALSE(tree.ok());
    EXPECT_EQ(tree.status().code(), StatusCode::kDataLoss);
    EXPECT_THAT(tree.status().message(), HasSubstr(c.message));
  }
}

TEST(PickleTest, AccessorsOnTheWrongKindAreSafe) {
  ASSERT_OK_AND_ASSIGN(PickleTree tree, Parse(FromHex("80044b052e")));  // 5
  const PickleValue v = tree.root();
  EXPECT_TRUE(v.item(3).is_none());
  EXPECT_TRUE(v.key(0).is_none());
  EXPECT_TRUE(v.callable().is_none());
  EXPECT_TRUE(v.persistent_id().is_none());
  EXPECT_EQ(v.global_module(), "");
  EXPECT_FALSE(v.state().has_value());
  EXPECT_FALSE(v.ObjectClass().has_value());
  EXPECT_THAT(v.ExpectTuple(2).status().message(), HasSubstr("expected a tuple of 2, found int 5"));
}

// ---- CRC-32 -------------------------------------------------------------------------------------

TEST(Crc32Test, KnownValuesStreamingAndCombine) {
  EXPECT_EQ(Crc32("123456789", 9), 0xCBF43926u);  // the CRC-32/ISO-HDLC check value
  EXPECT_EQ(Crc32("", 0), 0u);
  const std::vector<uint8_t> data = tessera::testing::RandomBytes(1 << 20, 3);
  const uint32_t whole = Crc32(data.data(), data.size());
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    const size_t cut = rng() % (data.size() + 1);
    const uint32_t a = Crc32(data.data(), cut);
    const uint32_t b = Crc32(data.data() + cut, data.size() - cut);
    EXPECT_EQ(Crc32Combine(a, b, data.size() - cut), whole) << "cut " << cut;
    EXPECT_EQ(Crc32(data.data() + cut, data.size() - cut, a), whole);
  }
  Crc32Stream s;
  for (size_t at = 0; at < data.size(); at += 256 * 1024 - 5) {
    s.Update(data.data() + at, std::min<size_t>(256 * 1024 - 5, data.size() - at));
  }
  EXPECT_EQ(s.value(), whole);
  EXPECT_EQ(s.length(), data.size());
  Crc32Stream t;
  t.Append(Crc32(data.data(), 1000), 1000);
  t.Update(data.data() + 1000, data.size() - 1000);
  EXPECT_EQ(t.value(), whole);
}

TEST(TorchDTypeTest, EveryTesseraDTypeHasATorchName) {
  for (DType d : kAllDTypes) {
    const TorchDType& t = TorchDTypeOf(d);
    EXPECT_EQ(t.dtype, d) << DTypeName(d);
    EXPECT_EQ(t.element_size, DTypeSize(d)) << DTypeName(d);
    EXPECT_EQ(*DTypeFromTorchName(t.name), d);
  }
  EXPECT_EQ(FindTorchDType("float")->name, "float32");
  EXPECT_EQ(FindTorchDTypeByStorageClass("BFloat16Storage")->name, "bfloat16");
  EXPECT_EQ(FindTorchDType("qint8"), nullptr);
  EXPECT_THAT(DTypeFromTorchName("complex64").status().message(), HasSubstr("no tessera"));
}

// ---- differential: tessera's reader against Python's unpickler (issue 30, item 8) ---------
// testdata/pickle_differential/: crafted pickles and Python's `pickle.loads` of each, rendered
// as text by make_cases.py. Render() renders tessera's tree the same way.

std::string Hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += {digits[c >> 4], digits[c & 15]};
  return out;
}

// make_cases.py's render(), over tessera's tree. Objects: argparse.Namespace-like records
// whose attributes are the BUILD state (a dict, or a (dict, slots) pair, merged in order).
std::string Render(const PickleValue& v) {
  auto join = [](const PickleValue& seq, bool sorted) {
    std::vector<std::string> parts;
    for (size_t i = 0; i < seq.size(); ++i) parts.push_back(Render(seq.item(i)));
    if (sorted) std::sort(parts.begin(), parts.end());
    std::string out;
    for (size_t i = 0; i < parts.size(); ++i) out += (i ? "," : "") + parts[i];
    return out;
  };
  auto pairs = [](const std::vector<PickleValue>& dicts) {
    std::string out;
    for (const PickleValue& d : dicts) {
      for (size_t i = 0; i < d.size(); ++i) {
        out += (out.empty() ? "" : ",") + Render(d.key(i)) + ":" + Render(d.value(i));
      }
    }
    return "{" + out + "}";
  };
  switch (v.kind()) {
    case PickleKind::kNone:
      return "None";
    case PickleKind::kBool:
      return *v.AsInt() ? "True" : "False";
    case PickleKind::kInt:
      return std::to_string(*v.AsInt());
    case PickleKind::kFloat: {
      char buf[40];
      std::snprintf(buf, sizeof(buf), "%.17g", *v.AsFloat());
      return std::string("f") + buf;
    }
    case PickleKind::kStr:
      return "s" + Hex(*v.AsStr());
    case PickleKind::kBytes:
      return "b" + Hex(*v.AsBytes());
    case PickleKind::kList:
      return "[" + join(v, false) + "]";
    case PickleKind::kTuple:
      return "(" + join(v, false) + ")";
    case PickleKind::kSet:
      return "{" + join(v, true) + "}";
    case PickleKind::kDict:
      return pairs({v});
    case PickleKind::kNewObj:
    case PickleKind::kReduce: {
      const std::optional<PickleValue> cls = v.ObjectClass();
      std::vector<PickleValue> attrs;
      if (std::optional<PickleValue> state = v.state()) {
        if (state->is(PickleKind::kTuple)) {
          for (size_t i = 0; i < state->size(); ++i) attrs.push_back(state->item(i));
        } else {
          attrs.push_back(*state);
        }
      }
      return "obj(" +
             (cls ? std::string(cls->global_module()) + "." + std::string(cls->global_name())
                  : "?") +
             "," + pairs(attrs) + ")";
    }
    default:
      return "<" + std::string(PickleKindName(v.kind())) + ">";
  }
}

TEST(PickleDifferentialTest, EveryCraftedPickleReadsAsPythonReadsItOrIsRefusedNamingTheKey) {
  const std::string dir =
      std::string(TESSERA_SOURCE_DIR) + "/src/format/torch_dist/testdata/pickle_differential/";
  std::ifstream in(dir + "cases.json");
  ASSERT_TRUE(in) << dir << "cases.json";
  const nlohmann::json cases = nlohmann::json::parse(in);
  ASSERT_GE(cases.size(), 15u);
  int refused = 0, equal = 0;
  for (const nlohmann::json& c : cases) {
    const std::string name = c["name"];
    std::ifstream f(dir + c["file"].get<std::string>(), std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), {});
    ASSERT_FALSE(bytes.empty()) << name;
    Result<PickleTree> tree = ParsePickle(std::move(bytes), name);
    if (c["sets_a_key_twice"].get<bool>()) {
      // Python keeps the last value; tessera refuses, naming what is set twice.
      ASSERT_FALSE(tree.ok()) << name << ": read as " << Render(tree->root()) << ", Python reads "
                              << c["python"].get<std::string>();
      EXPECT_EQ(tree.status().code(), StatusCode::kDataLoss) << name;
      EXPECT_THAT(tree.status().message(),
                  ::testing::AnyOf(HasSubstr("is set twice"), HasSubstr("second BUILD")))
          << name;
      EXPECT_THAT(tree.status().message(), HasSubstr(name)) << "names the source";
      ++refused;
    } else {
      ASSERT_TRUE(tree.ok()) << name << ": " << tree.status().ToString();
      EXPECT_EQ(Render(tree->root()), c["python"].get<std::string>()) << name;
      ++equal;
    }
  }
  EXPECT_GE(refused, 8);
  EXPECT_GE(equal, 8);
}

TEST(PickleDifferentialTest, TheRefusalNamesTheKeySetTwice) {
  const std::string dir =
      std::string(TESSERA_SOURCE_DIR) + "/src/format/torch_dist/testdata/pickle_differential/";
  for (const char* file :
       {"dup_key_setitems.pkl", "dup_build_attr.pkl", "dup_build_dict_and_slots.pkl"}) {
    std::ifstream f(dir + file, std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), {});
    Result<PickleTree> tree = ParsePickle(std::move(bytes), file);
    ASSERT_FALSE(tree.ok()) << file;
    EXPECT_THAT(tree.status().message(), ::testing::ContainsRegex("'[ax]' is set twice")) << file;
    EXPECT_THAT(tree.status().message(), HasSubstr("Python keeps the last value")) << file;
  }
}

}  // namespace
}  // namespace tessera::torch_dist
