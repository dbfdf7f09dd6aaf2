#include "format/torch_dist/pickle.h"
#include "core/hex.h"

#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <unordered_map>

#include "core/utf8.h"

namespace tessera::torch_dist {
namespace {

// Opcodes (Python's Lib/pickle.py names).
enum Op : uint8_t {
  kMark = '(',
  kStop = '.',
  kPop = '0',
  kPopMark = '1',
  kDup = '2',
  kFloat = 'F',
  kInt = 'I',
  kBinInt = 'J',
  kBinInt1 = 'K',
  kLong = 'L',
  kBinInt2 = 'M',
  kNone = 'N',
  kPersId = 'P',
  kBinPersId = 'Q',
  kReduce = 'R',
  kString = 'S',
  kBinString = 'T',
  kShortBinString = 'U',
  kUnicode = 'V',
  kBinUnicode = 'X',
  kAppend = 'a',
  kBuild = 'b',
  kGlobal = 'c',
  kDict = 'd',
  kEmptyDict = '}',
  kAppends = 'e',
  kGet = 'g',
  kBinGet = 'h',
  kInst = 'i',
  kLongBinGet = 'j',
  kList = 'l',
  kEmptyList = ']',
  kObj = 'o',
  kPut = 'p',
  kBinPut = 'q',
  kLongBinPut = 'r',
  kSetItem = 's',
  kTuple = 't',
  kEmptyTuple = ')',
  kSetItems = 'u',
  kBinFloat = 'G',
  // protocol 2
  kProto = 0x80,
  kNewObj = 0x81,
  kExt1 = 0x82,
  kExt2 = 0x83,
  kExt4 = 0x84,
  kTuple1 = 0x85,
  kTuple2 = 0x86,
  kTuple3 = 0x87,
  kNewTrue = 0x88,
  kNewFalse = 0x89,
  kLong1 = 0x8a,
  kLong4 = 0x8b,
  // protocol 3
  kBinBytes = 'B',
  kShortBinBytes = 'C',
  // protocol 4
  kShortBinUnicode = 0x8c,
  kBinUnicode8 = 0x8d,
  kBinBytes8 = 0x8e,
  kEmptySet = 0x8f,
  kAddItems = 0x90,
  kFrozenSet = 0x91,
  kNewObjEx = 0x92,
  kStackGlobal = 0x93,
  kMemoize = 0x94,
  kFrame = 0x95,
  // protocol 5
  kByteArray8 = 0x96,
  kNextBuffer = 0x97,
  kReadOnlyBuffer = 0x98,
};

const char* OpName(uint8_t op) {
  switch (op) {
    case kMark:
      return "MARK";
    case kStop:
      return "STOP";
    case kPop:
      return "POP";
    case kPopMark:
      return "POP_MARK";
    case kDup:
      return "DUP";
    case kFloat:
      return "FLOAT";
    case kInt:
      return "INT";
    case kBinInt:
      return "BININT";
    case kBinInt1:
      return "BININT1";
    case kLong:
      return "LONG";
    case kBinInt2:
      return "BININT2";
    case kNone:
      return "NONE";
    case kPersId:
      return "PERSID";
    case kBinPersId:
      return "BINPERSID";
    case kReduce:
      return "REDUCE";
    case kString:
      return "STRING";
    case kBinString:
      return "BINSTRING";
    case kShortBinString:
      return "SHORT_BINSTRING";
    case kUnicode:
      return "UNICODE";
    case kBinUnicode:
      return "BINUNICODE";
    case kAppend:
      return "APPEND";
    case kBuild:
      return "BUILD";
    case kGlobal:
      return "GLOBAL";
    case kDict:
      return "DICT";
    case kEmptyDict:
      return "EMPTY_DICT";
    case kAppends:
      return "APPENDS";
    case kGet:
      return "GET";
    case kBinGet:
      return "BINGET";
    case kInst:
      return "INST";
    case kLongBinGet:
      return "LONG_BINGET";
    case kList:
      return "LIST";
    case kEmptyList:
      return "EMPTY_LIST";
    case kObj:
      return "OBJ";
    case kPut:
      return "PUT";
    case kBinPut:
      return "BINPUT";
    case kLongBinPut:
      return "LONG_BINPUT";
    case kSetItem:
      return "SETITEM";
    case kTuple:
      return "TUPLE";
    case kEmptyTuple:
      return "EMPTY_TUPLE";
    case kSetItems:
      return "SETITEMS";
    case kBinFloat:
      return "BINFLOAT";
    case kProto:
      return "PROTO";
    case kNewObj:
      return "NEWOBJ";
    case kExt1:
      return "EXT1";
    case kExt2:
      return "EXT2";
    case kExt4:
      return "EXT4";
    case kTuple1:
      return "TUPLE1";
    case kTuple2:
      return "TUPLE2";
    case kTuple3:
      return "TUPLE3";
    case kNewTrue:
      return "NEWTRUE";
    case kNewFalse:
      return "NEWFALSE";
    case kLong1:
      return "LONG1";
    case kLong4:
      return "LONG4";
    case kBinBytes:
      return "BINBYTES";
    case kShortBinBytes:
      return "SHORT_BINBYTES";
    case kShortBinUnicode:
      return "SHORT_BINUNICODE";
    case kBinUnicode8:
      return "BINUNICODE8";
    case kBinBytes8:
      return "BINBYTES8";
    case kEmptySet:
      return "EMPTY_SET";
    case kAddItems:
      return "ADDITEMS";
    case kFrozenSet:
      return "FROZENSET";
    case kNewObjEx:
      return "NEWOBJ_EX";
    case kStackGlobal:
      return "STACK_GLOBAL";
    case kMemoize:
      return "MEMOIZE";
    case kFrame:
      return "FRAME";
    case kByteArray8:
      return "BYTEARRAY8";
    case kNextBuffer:
      return "NEXT_BUFFER";
    case kReadOnlyBuffer:
      return "READONLY_BUFFER";
    default:
      return nullptr;
  }
}

// Which of PickleParser's Step* functions handles an opcode: Step is one load from this table
// and a small switch. Each Step* switch covers exactly the opcodes listed for its family here
// (one left out of a switch would fail as an unknown opcode).
enum class OpFamily : uint8_t {
  kUnsupported,  // refused or undefined (StepUnsupported)
  kFraming,
  kStack,
  kScalar,
  kText,
  kNewContainer,
  kAddItems,
  kMemo,
  kRecord,
};

constexpr std::array<OpFamily, 256> kOpFamily = [] {
  std::array<OpFamily, 256> family{};  // kUnsupported
  auto set = [&](OpFamily f, std::initializer_list<Op> ops) {
    for (Op op : ops) family[op] = f;
  };
  set(OpFamily::kFraming, {kProto, kFrame, kStop});
  set(OpFamily::kStack, {kMark, kPop, kPopMark, kDup});
  set(OpFamily::kScalar, {kNone, kNewTrue, kNewFalse, kBinInt1, kBinInt2, kBinInt, kLong1, kLong4,
                          kInt, kLong, kFloat, kBinFloat});
  set(OpFamily::kText, {kShortBinUnicode, kBinUnicode, kBinUnicode8, kShortBinString, kBinString,
                        kShortBinBytes, kBinBytes, kBinBytes8, kByteArray8});
  set(OpFamily::kNewContainer, {kEmptyTuple, kTuple1, kTuple2, kTuple3, kTuple, kEmptyList,
                                kEmptyDict, kEmptySet, kList, kDict, kFrozenSet});
  set(OpFamily::kAddItems, {kAppend, kAppends, kAddItems, kSetItem, kSetItems});
  set(OpFamily::kMemo, {kBinPut, kLongBinPut, kMemoize, kBinGet, kLongBinGet, kPut, kGet});
  set(OpFamily::kRecord,
      {kGlobal, kStackGlobal, kReduce, kNewObj, kNewObjEx, kBuild, kBinPersId, kPersId});
  return family;
}();

// Shared constant nodes, created first in every tree.
constexpr uint32_t kNoneId = 0;
constexpr uint32_t kFalseId = 1;
constexpr uint32_t kTrueId = 2;
constexpr uint32_t kEmptyTupleId = 3;
constexpr uint32_t kSmallIntBase = 4;  // ints 0..255
constexpr uint32_t kFirstFreeId = kSmallIntBase + 256;

}  // namespace

// ---- the parser -----------------------------------------------------------------------------

class PickleParser {
 public:
  PickleParser(std::span<const uint8_t> bytes, std::string_view source, PickleTree* tree)
      : data_(bytes.data()), size_(bytes.size()), source_(source), t_(*tree) {}

  Status Run();
  // Makes Run stop (with an error) when it creates node `id`; found_at() is then the offset of
  // the opcode that did.
  void StopAtNode(uint32_t id) { stop_at_node_ = id; }
  std::optional<uint64_t> found_at() const { return found_at_; }

 private:
  using Payload = PickleTree::Payload;
  static constexpr uint32_t kNoIndex = PickleTree::kNoIndex;

  // A run of children of a list/dict/set in children_, linked while parsing; Finalize() makes
  // every container's children contiguous. `last`: in a container's first segment, its last.
  struct Segment {
    uint32_t start, count, next, last;
  };

  // One opcode `op` (== op_), its operands read from pos_ on. Step dispatches by kOpFamily to
  // one of the Step* functions; a family's default case is never reached.
  Status Step(uint8_t op);
  Status StepFraming(uint8_t op);
  Status StepStack(uint8_t op);
  Status StepScalar(uint8_t op);
  Status StepText(uint8_t op);
  Status StepNewContainer(uint8_t op);
  Status StepAddItems(uint8_t op);
  Status StepMemo(uint8_t op);
  Status StepRecord(uint8_t op);
  Status StepUnsupported(uint8_t op) const;
  Status Fail(std::string what) const {
    std::string message =
        std::string(source_) + ": pickle: " + what + " at offset " + std::to_string(op_offset_);
    if (const char* name = OpName(op_)) {
      message += std::string(" (opcode ") + name + " 0x" + HexByte(op_) + ")";
    } else {
      message += " (opcode 0x" + HexByte(op_) + ")";
    }
    return DataLoss(std::move(message));
  }
  Status Truncated(uint64_t need) const {
    return Fail("truncated: " + std::to_string(need) + " more bytes needed, " +
                std::to_string(size_ - pos_) + " left");
  }

  // Reading operands.
  Status Need(uint64_t n) const { return n <= size_ - pos_ ? Status() : Truncated(n); }
  template <typename T>
  T LoadLE(uint64_t at) const {
    T v;
    std::memcpy(&v, data_ + at, sizeof(T));
    return v;  // the library targets little-endian hosts (x86-64, aarch64)
  }
  Result<std::string_view> Line();  // up to '\n', which is consumed

  // Nodes.
  Result<uint32_t> NewNode(PickleKind kind, const Payload& payload) {
    if (t_.kinds_.size() >= kNoIndex - 1) return Fail("too many nodes");
    if (t_.kinds_.size() == stop_at_node_) {
      found_at_ = op_offset_;
      return Fail("stopped at the node looked for");
    }
    t_.kinds_.push_back(static_cast<uint8_t>(kind));
    t_.payloads_.push_back(payload);
    return static_cast<uint32_t>(t_.kinds_.size() - 1);
  }
  static Payload Zero() {
    Payload p;
    std::memset(&p, 0, sizeof(p));
    return p;
  }
  Result<uint32_t> NewInt(int64_t v) {
    if (v >= 0 && v < 256) return kSmallIntBase + static_cast<uint32_t>(v);
    Payload p = Zero();
    p.i = v;
    return NewNode(PickleKind::kInt, p);
  }
  Result<uint32_t> NewText(PickleKind kind, uint64_t offset, uint64_t length) {
    Payload p = Zero();
    p.p.a = static_cast<uint32_t>(offset);
    p.p.count = static_cast<uint32_t>(length);
    return NewNode(kind, p);
  }
  // A node whose children are the given ids, stored contiguously now; an object (reduce,
  // newobj) gets one more slot, for the index of its ObjectExtra.
  Result<uint32_t> NewFixed(PickleKind kind, std::span<const uint32_t> children) {
    const bool object = kind == PickleKind::kReduce || kind == PickleKind::kNewObj;
    TESSERA_RETURN_IF_ERROR(RoomForChildren(children.size() + (object ? 1 : 0)));
    Payload p = Zero();
    p.p.a = static_cast<uint32_t>(t_.children_.size());
    p.p.count = static_cast<uint32_t>(children.size());
    t_.children_.append(children.data(), children.size());
    if (object) t_.children_.push_back(kNoIndex);
    return NewNode(kind, p);
  }
  // Children are numbered with 32 bits.
  Status RoomForChildren(uint64_t n) const {
    if (t_.children_.size() + n < kNoIndex) return Status();
    return Fail("more than 2^32 container children");
  }
  Result<uint32_t> NewGrowable(PickleKind kind) {
    Payload p = Zero();
    p.p.a = kNoIndex;  // first segment
    p.p.count = 0;     // children so far
    return NewNode(kind, p);
  }
  // The index in children_ of object `id`'s ObjectExtra slot.
  size_t ExtraSlot(uint32_t id) const {
    const Payload& n = t_.payloads_[id];
    return size_t{n.p.a} + n.p.count;
  }
  // Object `id`'s ObjectExtra, created on first use.
  PickleTree::ObjectExtra& Extra(uint32_t id) {
    const size_t slot = ExtraSlot(id);
    if (t_.children_[slot] == kNoIndex) {
      t_.objects_.push_back({kNoIndex, kNoIndex, kNoIndex});
      t_.children_[slot] = static_cast<uint32_t>(t_.objects_.size() - 1);
    }
    return t_.objects_[t_.children_[slot]];
  }
  // Appends stack_[from..end) to the growable container `id`, then drops them from the stack.
  Status AppendChildren(uint32_t id, size_t from);
  Result<uint32_t> ObjectItems(uint32_t object_id, PickleKind kind);

  // The stack.
  Status Push(uint32_t id) {
    stack_.push_back(id);
    return Status();
  }
  Result<uint32_t> Pop() {
    if (stack_.size() <= Fence()) return Fail("stack underflow");
    uint32_t id = stack_.back();
    stack_.pop_back();
    return id;
  }
  Result<uint32_t> Top() const {
    if (stack_.size() <= Fence()) return Fail("stack underflow");
    return stack_.back();
  }
  size_t Fence() const { return marks_.empty() ? 0 : size_t{marks_.back()}; }
  Result<size_t> PopMark() {
    if (marks_.empty()) return Fail("no MARK before it");
    size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }

  // The memo.
  Status Put(uint64_t index);
  Status Get(uint64_t index);

  Status PushInt(int64_t v) {
    TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewInt(v));
    return Push(id);
  }
  Status PushText(PickleKind kind, uint64_t length) {
    TESSERA_RETURN_IF_ERROR(Need(length));
    TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewText(kind, pos_, length));
    pos_ += length;
    return Push(id);
  }
  Status PushLong(uint64_t length);
  Status TupleFrom(size_t from);
  Status OpAppends(size_t from);
  Status OpSetItems(size_t from);
  Status OpBuild();
  Status OpObject(PickleKind kind, int n_parts);
  Status OpGlobal();
  Status OpStackGlobal();
  Status OpTextNumber();
  Status OpBinFloat();
  Status OpContainerFromMark(PickleKind kind);
  Status OpTextMemo(uint8_t op);

  Status Finalize();
  Status CheckNoKeySetTwice() const;

  const uint8_t* data_;
  uint64_t size_;
  std::string_view source_;
  PickleTree& t_;
  uint64_t pos_ = 0;
  uint64_t op_offset_ = 0;
  uint8_t op_ = 0;
  bool stopped_ = false;
  std::vector<uint32_t> stack_;
  std::vector<uint32_t> marks_;  // stack sizes (< 2^32: every push costs a byte of input)
  std::vector<Segment> segments_;
  std::vector<uint32_t> memo_;                       // index -> node id, kNoIndex when unset
  std::unordered_map<uint64_t, uint32_t> memo_far_;  // indices beyond memo_'s bound
  uint64_t memo_count_ = 0;                          // distinct indices set (MEMOIZE's next)
  uint64_t stop_at_node_ = kNoIndex;
  std::optional<uint64_t> found_at_;
};

Result<std::string_view> PickleParser::Line() {
  const void* nl = std::memchr(data_ + pos_, '\n', size_ - pos_);
  if (nl == nullptr) return Fail("truncated: no end of line");
  uint64_t end = static_cast<const uint8_t*>(nl) - data_;
  std::string_view line(reinterpret_cast<const char*>(data_) + pos_, end - pos_);
  pos_ = end + 1;
  return line;
}

Status PickleParser::AppendChildren(uint32_t id, size_t from) {
  const uint32_t count = static_cast<uint32_t>(stack_.size() - from);
  if (count == 0) return Status();
  TESSERA_RETURN_IF_ERROR(RoomForChildren(count));
  Payload& n = t_.payloads_[id];
  const uint32_t start = static_cast<uint32_t>(t_.children_.size());
  t_.children_.append(stack_.data() + from, count);
  stack_.resize(from);
  n.p.count += count;
  const uint32_t first = n.p.a;
  if (first != kNoIndex) {
    Segment& last = segments_[segments_[first].last];
    if (last.start + last.count == start) {  // still the last run of children: extend it
      last.count += count;
      return Status();
    }
  }
  const uint32_t seg = static_cast<uint32_t>(segments_.size());
  segments_.push_back({start, count, kNoIndex, seg});
  if (first == kNoIndex) {
    n.p.a = seg;
  } else {
    segments_[segments_[first].last].next = seg;
    segments_[first].last = seg;
  }
  return Status();
}

Result<uint32_t> PickleParser::ObjectItems(uint32_t object_id, PickleKind kind) {
  const bool list = kind == PickleKind::kList;
  const uint32_t current = list ? Extra(object_id).list_items : Extra(object_id).dict_items;
  if (current != kNoIndex) return current;
  TESSERA_ASSIGN_OR_RETURN(uint32_t items, NewGrowable(kind));
  (list ? Extra(object_id).list_items : Extra(object_id).dict_items) = items;
  return items;
}

Status PickleParser::Put(uint64_t index) {
  TESSERA_ASSIGN_OR_RETURN(uint32_t id, Top());
  // A real pickler numbers memo entries 0, 1, 2, ...: a vector. Any index up to the input size
  // is accepted there (each PUT costs at least 2 bytes of input, so the vector stays linear in
  // the input); a stray larger index goes to a hash map.
  if (index < memo_.size() || index <= size_) {
    if (index >= memo_.size()) {
      memo_.resize(std::max<uint64_t>(index + 1, std::min<uint64_t>(memo_.size() * 2, size_ + 1)),
                   kNoIndex);
    }
    if (memo_[index] == kNoIndex) ++memo_count_;
    memo_[index] = id;
  } else {
    if (memo_far_.emplace(index, id).second) ++memo_count_;
    memo_far_[index] = id;
  }
  return Status();
}

Status PickleParser::Get(uint64_t index) {
  uint32_t id = kNoIndex;
  if (index < memo_.size()) {
    id = memo_[index];
  } else if (auto it = memo_far_.find(index); it != memo_far_.end()) {
    id = it->second;
  }
  if (id == kNoIndex) return Fail("memo index " + std::to_string(index) + " was never stored");
  return Push(id);
}

Status PickleParser::PushLong(uint64_t length) {
  TESSERA_RETURN_IF_ERROR(Need(length));
  const uint8_t* p = data_ + pos_;
  // Little-endian two's complement. It fits in int64 when every byte past the 8th repeats the
  // sign of byte 7.
  bool fits = true;
  if (length > 8) {
    const uint8_t sign = (p[7] & 0x80) ? 0xFF : 0x00;
    for (uint64_t i = 8; i < length; ++i) fits = fits && p[i] == sign;
  }
  if (!fits) {
    TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewText(PickleKind::kBigInt, pos_, length));
    pos_ += length;
    return Push(id);
  }
  uint64_t v = 0;
  const uint64_t n = std::min<uint64_t>(length, 8);
  for (uint64_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  if (n > 0 && n < 8 && (p[n - 1] & 0x80)) v |= ~uint64_t{0} << (8 * n);  // sign-extend
  pos_ += length;
  return PushInt(static_cast<int64_t>(v));
}

Status PickleParser::TupleFrom(size_t from) {
  const size_t n = stack_.size() - from;
  uint32_t id = kEmptyTupleId;
  if (n > 0) {
    TESSERA_ASSIGN_OR_RETURN(
        id, NewFixed(PickleKind::kTuple, std::span<const uint32_t>(stack_.data() + from, n)));
  }
  stack_.resize(from);
  return Push(id);
}

Status PickleParser::OpAppends(size_t from) {
  if (from <= Fence()) return Fail("stack underflow: no list below the items");
  const uint32_t target = stack_[from - 1];
  const PickleKind kind = t_.kind(target);
  if (kind == PickleKind::kList || (op_ == kAddItems && kind == PickleKind::kSet)) {
    return AppendChildren(target, from);
  }
  if (op_ != kAddItems && (kind == PickleKind::kReduce || kind == PickleKind::kNewObj)) {
    TESSERA_ASSIGN_OR_RETURN(uint32_t items, ObjectItems(target, PickleKind::kList));
    return AppendChildren(items, from);
  }
  return Fail(std::string("cannot add items to a ") + std::string(PickleKindName(kind)));
}

Status PickleParser::OpSetItems(size_t from) {
  if (from <= Fence()) return Fail("stack underflow: no dict below the items");
  if ((stack_.size() - from) % 2 != 0) return Fail("odd number of items for a dict");
  const uint32_t target = stack_[from - 1];
  const PickleKind kind = t_.kind(target);
  if (kind == PickleKind::kDict) {
    return AppendChildren(target, from);
  }
  if (kind == PickleKind::kReduce || kind == PickleKind::kNewObj) {
    TESSERA_ASSIGN_OR_RETURN(uint32_t items, ObjectItems(target, PickleKind::kDict));
    return AppendChildren(items, from);
  }
  return Fail(std::string("cannot set items of a ") + std::string(PickleKindName(kind)));
}

Status PickleParser::OpBuild() {
  TESSERA_ASSIGN_OR_RETURN(uint32_t state, Pop());
  TESSERA_ASSIGN_OR_RETURN(uint32_t target, Top());
  const PickleKind kind = t_.kind(target);
  if (kind != PickleKind::kReduce && kind != PickleKind::kNewObj) {
    return Fail(std::string("BUILD of a ") + std::string(PickleKindName(kind)));
  }
  PickleTree::ObjectExtra& extra = Extra(target);
  if (extra.state != kNoIndex) return Fail("second BUILD of one object");
  extra.state = state;
  return Status();
}

// REDUCE (2 parts: callable, args), NEWOBJ (2: cls, args), NEWOBJ_EX (3: cls, args, kwargs).
Status PickleParser::OpObject(PickleKind kind, int n_parts) {
  uint32_t parts[3];
  for (int i = n_parts - 1; i >= 0; --i) {
    TESSERA_ASSIGN_OR_RETURN(parts[i], Pop());
  }
  if (t_.kind(parts[1]) != PickleKind::kTuple) {
    return Fail("arguments are a " + std::string(PickleKindName(t_.kind(parts[1]))) +
                ", not a tuple");
  }
  if (n_parts == 3 && t_.kind(parts[2]) != PickleKind::kDict) {
    return Fail("keyword arguments are a " + std::string(PickleKindName(t_.kind(parts[2]))) +
                ", not a dict");
  }
  TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewFixed(kind, std::span<const uint32_t>(parts, n_parts)));
  return Push(id);
}

Status PickleParser::OpGlobal() {
  const uint64_t module_at = pos_;
  TESSERA_ASSIGN_OR_RETURN(std::string_view module, Line());
  const uint64_t name_at = pos_;
  TESSERA_ASSIGN_OR_RETURN(std::string_view name, Line());
  TESSERA_ASSIGN_OR_RETURN(uint32_t m, NewText(PickleKind::kStr, module_at, module.size()));
  TESSERA_ASSIGN_OR_RETURN(uint32_t n, NewText(PickleKind::kStr, name_at, name.size()));
  const uint32_t parts[2] = {m, n};
  TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewFixed(PickleKind::kGlobal, parts));
  return Push(id);
}

Status PickleParser::OpStackGlobal() {
  TESSERA_ASSIGN_OR_RETURN(uint32_t name, Pop());
  TESSERA_ASSIGN_OR_RETURN(uint32_t module, Pop());
  if (t_.kind(module) != PickleKind::kStr || t_.kind(name) != PickleKind::kStr) {
    return Fail("module and name are not both str");
  }
  const uint32_t parts[2] = {module, name};
  TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewFixed(PickleKind::kGlobal, parts));
  return Push(id);
}

// INT, LONG, FLOAT: a decimal number on one line.
Status PickleParser::OpTextNumber() {
  TESSERA_ASSIGN_OR_RETURN(std::string_view line, Line());
  if (op_ == kFloat) {
    Payload n = Zero();
    auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), n.f);
    if (ec != std::errc() || end != line.data() + line.size()) {
      return Fail("bad float '" + std::string(line.substr(0, 40)) + "'");
    }
    TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewNode(PickleKind::kFloat, n));
    return Push(id);
  }
  if (op_ == kInt && line == "00") return Push(kFalseId);
  if (op_ == kInt && line == "01") return Push(kTrueId);
  if (op_ == kLong && !line.empty() && line.back() == 'L') line.remove_suffix(1);
  std::string_view digits = line;
  if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
  int64_t v = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec == std::errc::result_out_of_range) {
    return Fail("integer '" + std::string(line.substr(0, 40)) + "' beyond 64 bits");
  }
  if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty()) {
    return Fail("bad integer '" + std::string(line.substr(0, 40)) + "'");
  }
  return PushInt(v);
}

Status PickleParser::Step(uint8_t op) {
  switch (kOpFamily[op]) {
    case OpFamily::kFraming:
      return StepFraming(op);
    case OpFamily::kStack:
      return StepStack(op);
    case OpFamily::kScalar:
      return StepScalar(op);
    case OpFamily::kText:
      return StepText(op);
    case OpFamily::kNewContainer:
      return StepNewContainer(op);
    case OpFamily::kAddItems:
      return StepAddItems(op);
    case OpFamily::kMemo:
      return StepMemo(op);
    case OpFamily::kRecord:
      return StepRecord(op);
    case OpFamily::kUnsupported:
      break;
  }
  return StepUnsupported(op);
}

// The protocol, framing and STOP.
Status PickleParser::StepFraming(uint8_t op) {
  switch (op) {
    case kProto: {
      TESSERA_RETURN_IF_ERROR(Need(1));
      const uint8_t proto = data_[pos_++];
      if (proto > 5) return Fail("unsupported pickle protocol " + std::to_string(proto));
      return Status();
    }
    case kFrame: {
      TESSERA_RETURN_IF_ERROR(Need(8));
      const uint64_t frame = LoadLE<uint64_t>(pos_);
      pos_ += 8;
      if (frame > size_ - pos_) return Truncated(frame);
      return Status();
    }
    case kStop:
      stopped_ = true;
      return Status();
    default:
      return Fail("unknown opcode");
  }
}

// Marks and the stack itself.
Status PickleParser::StepStack(uint8_t op) {
  switch (op) {
    case kMark:
      marks_.push_back(static_cast<uint32_t>(stack_.size()));
      return Status();
    case kPop:
      // As CPython: a MARK on top of the stack is popped instead of an item.
      if (!marks_.empty() && marks_.back() == stack_.size()) {
        marks_.pop_back();
        return Status();
      }
      return Pop().status();
    case kPopMark: {
      TESSERA_ASSIGN_OR_RETURN(size_t from, PopMark());
      stack_.resize(from);
      return Status();
    }
    case kDup: {
      TESSERA_ASSIGN_OR_RETURN(uint32_t id, Top());
      return Push(id);
    }
    default:
      return Fail("unknown opcode");
  }
}

// None, bools, ints and floats.
Status PickleParser::StepScalar(uint8_t op) {
  switch (op) {
    case kNone:
      return Push(kNoneId);
    case kNewTrue:
      return Push(kTrueId);
    case kNewFalse:
      return Push(kFalseId);
    case kBinInt1:
      TESSERA_RETURN_IF_ERROR(Need(1));
      return PushInt(data_[pos_++]);
    case kBinInt2:
      TESSERA_RETURN_IF_ERROR(Need(2));
      pos_ += 2;
      return PushInt(LoadLE<uint16_t>(pos_ - 2));
    case kBinInt:
      TESSERA_RETURN_IF_ERROR(Need(4));
      pos_ += 4;
      return PushInt(LoadLE<int32_t>(pos_ - 4));
    case kLong1:
      TESSERA_RETURN_IF_ERROR(Need(1));
      return PushLong(data_[pos_++]);
    case kLong4: {
      TESSERA_RETURN_IF_ERROR(Need(4));
      const int32_t n = LoadLE<int32_t>(pos_);
      pos_ += 4;
      if (n < 0) return Fail("negative LONG4 length");
      return PushLong(static_cast<uint64_t>(n));
    }
    case kInt:
    case kLong:
    case kFloat:
      return OpTextNumber();
    case kBinFloat:
      return OpBinFloat();
    default:
      return Fail("unknown opcode");
  }
}

// BINFLOAT: an IEEE 754 double, big-endian.
Status PickleParser::OpBinFloat() {
  TESSERA_RETURN_IF_ERROR(Need(8));
  uint64_t bits = 0;
  for (int i = 0; i < 8; ++i) bits = (bits << 8) | data_[pos_ + i];  // big-endian
  pos_ += 8;
  Payload n = Zero();
  std::memcpy(&n.f, &bits, 8);
  TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewNode(PickleKind::kFloat, n));
  return Push(id);
}

// Strings and bytes: views into the input.
Status PickleParser::StepText(uint8_t op) {
  switch (op) {
    case kShortBinUnicode:
      TESSERA_RETURN_IF_ERROR(Need(1));
      return PushText(PickleKind::kStr, data_[pos_++]);
    case kBinUnicode:
      TESSERA_RETURN_IF_ERROR(Need(4));
      pos_ += 4;
      return PushText(PickleKind::kStr, LoadLE<uint32_t>(pos_ - 4));
    case kBinUnicode8:
      TESSERA_RETURN_IF_ERROR(Need(8));
      pos_ += 8;
      return PushText(PickleKind::kStr, LoadLE<uint64_t>(pos_ - 8));
    case kShortBinString:
      TESSERA_RETURN_IF_ERROR(Need(1));
      return PushText(PickleKind::kStr, data_[pos_++]);
    case kBinString: {
      TESSERA_RETURN_IF_ERROR(Need(4));
      const int32_t n = LoadLE<int32_t>(pos_);
      pos_ += 4;
      if (n < 0) return Fail("negative BINSTRING length");
      return PushText(PickleKind::kStr, static_cast<uint64_t>(n));
    }
    case kShortBinBytes:
      TESSERA_RETURN_IF_ERROR(Need(1));
      return PushText(PickleKind::kBytes, data_[pos_++]);
    case kBinBytes:
      TESSERA_RETURN_IF_ERROR(Need(4));
      pos_ += 4;
      return PushText(PickleKind::kBytes, LoadLE<uint32_t>(pos_ - 4));
    case kBinBytes8:
      TESSERA_RETURN_IF_ERROR(Need(8));
      pos_ += 8;
      return PushText(PickleKind::kBytes, LoadLE<uint64_t>(pos_ - 8));
    case kByteArray8:
      TESSERA_RETURN_IF_ERROR(Need(8));
      pos_ += 8;
      return PushText(PickleKind::kByteArray, LoadLE<uint64_t>(pos_ - 8));
    default:
      return Fail("unknown opcode");
  }
}

// Tuples, lists, dicts and sets, empty or made of the items above a MARK.
Status PickleParser::StepNewContainer(uint8_t op) {
  switch (op) {
    case kEmptyTuple:
      return Push(kEmptyTupleId);
    case kTuple1:
    case kTuple2:
    case kTuple3: {
      const size_t n = op - kTuple1 + 1;
      if (stack_.size() < Fence() + n) return Fail("stack underflow");
      return TupleFrom(stack_.size() - n);
    }
    case kTuple: {
      TESSERA_ASSIGN_OR_RETURN(size_t from, PopMark());
      return TupleFrom(from);
    }
    case kEmptyList:
    case kEmptyDict:
    case kEmptySet: {
      const PickleKind kind = op == kEmptyList   ? PickleKind::kList
                              : op == kEmptyDict ? PickleKind::kDict
                                                 : PickleKind::kSet;
      TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewGrowable(kind));
      return Push(id);
    }
    case kList:
    case kDict:
    case kFrozenSet:
      return OpContainerFromMark(op == kList   ? PickleKind::kList
                                 : op == kDict ? PickleKind::kDict
                                               : PickleKind::kSet);
    default:
      return Fail("unknown opcode");
  }
}

// LIST, DICT, FROZENSET: a container of `kind` holding the items above the MARK.
Status PickleParser::OpContainerFromMark(PickleKind kind) {
  TESSERA_ASSIGN_OR_RETURN(size_t from, PopMark());
  if (kind == PickleKind::kDict && (stack_.size() - from) % 2 != 0) {
    return Fail("odd number of items for a dict");
  }
  TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewGrowable(kind));
  TESSERA_RETURN_IF_ERROR(AppendChildren(id, from));
  return Push(id);
}

// Items added to the list, dict or set (or object) below them.
Status PickleParser::StepAddItems(uint8_t op) {
  switch (op) {
    case kAppend:
      if (stack_.size() < Fence() + 2) return Fail("stack underflow");
      return OpAppends(stack_.size() - 1);
    case kAppends:
    case kAddItems: {
      TESSERA_ASSIGN_OR_RETURN(size_t from, PopMark());
      return OpAppends(from);
    }
    case kSetItem:
      if (stack_.size() < Fence() + 3) return Fail("stack underflow");
      return OpSetItems(stack_.size() - 2);
    case kSetItems: {
      TESSERA_ASSIGN_OR_RETURN(size_t from, PopMark());
      return OpSetItems(from);
    }
    default:
      return Fail("unknown opcode");
  }
}

// The memo: PUT stores the top of the stack, GET pushes what was stored.
Status PickleParser::StepMemo(uint8_t op) {
  switch (op) {
    case kBinPut:
      TESSERA_RETURN_IF_ERROR(Need(1));
      return Put(data_[pos_++]);
    case kLongBinPut:
      TESSERA_RETURN_IF_ERROR(Need(4));
      pos_ += 4;
      return Put(LoadLE<uint32_t>(pos_ - 4));
    case kMemoize:
      return Put(memo_count_);
    case kBinGet:
      TESSERA_RETURN_IF_ERROR(Need(1));
      return Get(data_[pos_++]);
    case kLongBinGet:
      TESSERA_RETURN_IF_ERROR(Need(4));
      pos_ += 4;
      return Get(LoadLE<uint32_t>(pos_ - 4));
    case kPut:
    case kGet:
      return OpTextMemo(op);
    default:
      return Fail("unknown opcode");
  }
}

// PUT, GET (protocol 0): the memo index is a decimal number on one line.
Status PickleParser::OpTextMemo(uint8_t op) {
  TESSERA_ASSIGN_OR_RETURN(std::string_view line, Line());
  uint64_t index = 0;
  auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), index);
  if (ec != std::errc() || end != line.data() + line.size() || line.empty()) {
    return Fail("bad memo index '" + std::string(line.substr(0, 40)) + "'");
  }
  return op == kPut ? Put(index) : Get(index);
}

// What Python would import or call: inert records.
Status PickleParser::StepRecord(uint8_t op) {
  switch (op) {
    case kGlobal:
      return OpGlobal();
    case kStackGlobal:
      return OpStackGlobal();
    case kReduce:
      return OpObject(PickleKind::kReduce, 2);
    case kNewObj:
      return OpObject(PickleKind::kNewObj, 2);
    case kNewObjEx:
      return OpObject(PickleKind::kNewObj, 3);
    case kBuild:
      return OpBuild();
    case kBinPersId: {
      TESSERA_ASSIGN_OR_RETURN(uint32_t pid, Pop());
      TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewFixed(PickleKind::kPersId, {&pid, 1}));
      return Push(id);
    }
    case kPersId: {
      const uint64_t at = pos_;
      TESSERA_ASSIGN_OR_RETURN(std::string_view line, Line());
      TESSERA_ASSIGN_OR_RETURN(uint32_t pid, NewText(PickleKind::kStr, at, line.size()));
      TESSERA_ASSIGN_OR_RETURN(uint32_t id, NewFixed(PickleKind::kPersId, {&pid, 1}));
      return Push(id);
    }
    default:
      return Fail("unknown opcode");
  }
}

// Opcodes this reader refuses (header comment), and those pickle does not define.
Status PickleParser::StepUnsupported(uint8_t op) const {
  switch (op) {
    case kNextBuffer:
    case kReadOnlyBuffer:
      return Fail("out-of-band buffers are not supported");
    case kExt1:
    case kExt2:
    case kExt4:
      return Fail("the copyreg extension registry is not supported");
    case kString:
    case kUnicode:
    case kInst:
    case kObj:
      return Fail("protocol 0 opcode not supported");
    default:
      return Fail("unknown opcode");
  }
}

Status PickleParser::Finalize() {
  // Lists, dicts and sets grew in linked segments; give each one contiguous children. A
  // container with one segment keeps it in place, longer ones are copied once to the end.
  for (size_t id = 0; id < t_.kinds_.size(); ++id) {
    const PickleKind kind = t_.kind(static_cast<uint32_t>(id));
    if (kind != PickleKind::kList && kind != PickleKind::kDict && kind != PickleKind::kSet) {
      continue;
    }
    Payload& n = t_.payloads_[id];
    const uint32_t first = n.p.a;
    if (first == kNoIndex) {
      n.p.a = 0;
    } else if (segments_[first].next == kNoIndex) {
      n.p.a = segments_[first].start;
    } else {
      TESSERA_RETURN_IF_ERROR(RoomForChildren(n.p.count));
      const uint32_t start = static_cast<uint32_t>(t_.children_.size());
      for (uint32_t s = first; s != kNoIndex; s = segments_[s].next) {
        const Segment seg = segments_[s];
        for (uint32_t i = 0; i < seg.count; ++i) {
          t_.children_.push_back(t_.children_[seg.start + i]);  // a BlockArray never moves
        }
      }
      n.p.a = start;
    }
  }
  return Status();
}

Status PickleParser::Run() {
  if (size_ >= (uint64_t{1} << 32)) {
    return DataLoss(std::string(source_) + ": pickle: " + std::to_string(size_) +
                    " bytes is more than this reader accepts (4 GiB)");
  }
  t_.data_ = data_;
  t_.source_ = std::string(source_);
  auto constant = [&](PickleKind kind, int64_t value) {
    Payload p = Zero();
    p.i = value;
    t_.kinds_.push_back(static_cast<uint8_t>(kind));
    t_.payloads_.push_back(p);
  };
  constant(PickleKind::kNone, 0);
  constant(PickleKind::kBool, 0);
  constant(PickleKind::kBool, 1);
  constant(PickleKind::kTuple, 0);  // the empty tuple: no children
  for (int v = 0; v < 256; ++v) constant(PickleKind::kInt, v);
  memo_.assign(std::min<uint64_t>(size_ + 1, 1024), kNoIndex);

  while (!stopped_) {
    if (pos_ >= size_) {
      op_offset_ = pos_;
      op_ = 0;
      return DataLoss(std::string(source_) + ": pickle: ends at offset " + std::to_string(pos_) +
                      " without STOP");
    }
    op_offset_ = pos_;
    op_ = data_[pos_++];
    TESSERA_RETURN_IF_ERROR(Step(op_));
  }
  TESSERA_ASSIGN_OR_RETURN(t_.root_, Pop());
  t_.end_offset_ = pos_;
  TESSERA_RETURN_IF_ERROR(Finalize());
  return CheckNoKeySetTwice();
}

namespace {

// A dict key as Python compares it, for the keys whose equality is plain: str by its text,
// bytes by theirs, and numbers by value (1 == True == 1.0 in Python: one key). nullopt for the
// others (tuples, objects, ...), which tessera never looks up by value.
std::optional<std::string> KeyIdentity(const PickleValue& k) {
  switch (k.kind()) {
    case PickleKind::kStr:
      return "s" + std::string(*k.AsStr());
    case PickleKind::kBytes:
      return "b" + std::string(*k.AsBytes());
    case PickleKind::kInt:
    case PickleKind::kBool:
      return "i" + std::to_string(*k.AsInt());
    case PickleKind::kFloat: {
      const double f = *k.AsFloat();
      if (f != f) return std::nullopt;  // NaN: equal to nothing
      if (f == std::floor(f) && f >= -9.2e18 && f <= 9.2e18) {
        return "i" + std::to_string(static_cast<int64_t>(f));
      }
      std::string bits(sizeof(f), '\0');
      std::memcpy(bits.data(), &f, sizeof(f));
      return "f" + bits;
    }
    default:
      return std::nullopt;
  }
}

}  // namespace

// Python's unpickler lets a later SETITEM(S) (or a key repeated in one SETITEMS, or a BUILD's
// slots dict naming an attribute its dict also names) overwrite an earlier value, where a
// lookup here would find the first; a set keeps an item added twice once. Rather than give such
// pickles a meaning that could differ from Python's in some corner, every dict must hold each key
// once, and a BUILD's (dict, slots) state must not name one attribute in both: kDataLoss naming the
// key. No pickler writes such a stream (a dict cannot hold a key twice); only a crafted or damaged
// one does.
Status PickleParser::CheckNoKeySetTwice() const {
  auto refuse = [&](const PickleValue& key, const std::string& what) -> Status {
    const std::optional<uint64_t> at = t_.OffsetOf(key);
    const std::string name = key.is(PickleKind::kStr)
                                 ? "'" + EscapeControlCharacters(*key.AsStr()) + "'"
                                 : "of kind " + std::string(PickleKindName(key.kind()));
    return DataLoss(std::string(source_) + ": pickle: " + what + " " + name + " is set twice" +
                    (at ? " (the key at offset " + std::to_string(*at) + ")" : "") +
                    "; Python keeps the last value, and tessera refuses a pickle whose meaning "
                    "depends on which");
  };
  std::unordered_map<std::string, size_t> seen;
  for (uint32_t id = kFirstFreeId; id < t_.kinds_.size(); ++id) {
    const PickleValue v(&t_, id);
    if (v.is(PickleKind::kDict) && v.size() > 1) {
      seen.clear();
      for (size_t i = 0; i < v.size(); ++i) {
        const std::optional<std::string> k = KeyIdentity(v.key(i));
        if (k && !seen.emplace(*k, i).second) return refuse(v.key(i), "dict key");
      }
    }
    if (v.is(PickleKind::kSet) && v.size() > 1) {  // a set (or frozenset) holds an item once
      seen.clear();
      for (size_t i = 0; i < v.size(); ++i) {
        const std::optional<std::string> k = KeyIdentity(v.item(i));
        if (k && !seen.emplace(*k, i).second) return refuse(v.item(i), "set item");
      }
    }
    if (v.is(PickleKind::kReduce) || v.is(PickleKind::kNewObj)) {
      const std::optional<PickleValue> state = v.state();
      if (!state || !state->is(PickleKind::kTuple) || state->size() != 2) continue;
      const PickleValue dict = state->item(0), slots = state->item(1);
      if (!dict.is(PickleKind::kDict) || !slots.is(PickleKind::kDict)) continue;
      seen.clear();
      for (size_t i = 0; i < dict.size(); ++i) {
        if (std::optional<std::string> k = KeyIdentity(dict.key(i))) seen.emplace(*k, i);
      }
      for (size_t i = 0; i < slots.size(); ++i) {
        const std::optional<std::string> k = KeyIdentity(slots.key(i));
        if (k && seen.count(*k)) return refuse(slots.key(i), "attribute");
      }
    }
  }
  return Status();
}

Result<PickleTree> ParsePickle(std::span<const uint8_t> bytes, std::string_view source) {
  PickleTree tree;
  PickleParser parser(bytes, source, &tree);
  TESSERA_RETURN_IF_ERROR(parser.Run());
  return tree;
}

Result<PickleTree> ParsePickle(std::vector<uint8_t>&& bytes, std::string_view source) {
  PickleTree tree;
  tree.owned_ = std::move(bytes);
  PickleParser parser(tree.owned_, source, &tree);
  TESSERA_RETURN_IF_ERROR(parser.Run());
  return tree;
}

std::optional<uint64_t> PickleTree::OffsetOf(const PickleValue& value) const {
  if (value.id() < kFirstFreeId || value.id() >= kinds_.size()) return std::nullopt;
  PickleTree scratch;
  PickleParser parser(std::span<const uint8_t>(data_, end_offset_), source_, &scratch);
  parser.StopAtNode(value.id());
  (void)parser.Run();  // stops with an error at the node
  return parser.found_at();
}

// ---- accessors ------------------------------------------------------------------------------

std::string_view PickleKindName(PickleKind kind) {
  switch (kind) {
    case PickleKind::kNone:
      return "None";
    case PickleKind::kBool:
      return "bool";
    case PickleKind::kInt:
      return "int";
    case PickleKind::kBigInt:
      return "big int";
    case PickleKind::kFloat:
      return "float";
    case PickleKind::kStr:
      return "str";
    case PickleKind::kBytes:
      return "bytes";
    case PickleKind::kByteArray:
      return "bytearray";
    case PickleKind::kTuple:
      return "tuple";
    case PickleKind::kList:
      return "list";
    case PickleKind::kDict:
      return "dict";
    case PickleKind::kSet:
      return "set";
    case PickleKind::kGlobal:
      return "global";
    case PickleKind::kReduce:
      return "reduce";
    case PickleKind::kNewObj:
      return "newobj";
    case PickleKind::kPersId:
      return "persistent id";
  }
  return "?";
}

PickleKind PickleValue::kind() const { return tree_->kind(id_); }

bool PickleValue::IsGlobal(std::string_view module, std::string_view name) const {
  return is(PickleKind::kGlobal) && global_module() == module && global_name() == name;
}

std::string PickleValue::Describe() const {
  const PickleKind k = kind();
  const PickleTree::Payload& n = tree_->payload(id_);
  std::string name(PickleKindName(k));
  switch (k) {
    case PickleKind::kNone:
      return "None";
    case PickleKind::kBool:
      return n.i ? "True" : "False";
    case PickleKind::kInt:
      return "int " + std::to_string(n.i);
    case PickleKind::kFloat:
      return "float " + std::to_string(n.f);
    case PickleKind::kStr: {
      std::string_view s = tree_->Text(id_);
      return "str '" + std::string(s.substr(0, 60)) + (s.size() > 60 ? "...'" : "'");
    }
    case PickleKind::kBigInt:
    case PickleKind::kBytes:
    case PickleKind::kByteArray:
      return name + " of " + std::to_string(n.p.count) + " bytes";
    case PickleKind::kTuple:
    case PickleKind::kList:
    case PickleKind::kSet:
    case PickleKind::kDict:
      return name + " of " + std::to_string(size());
    case PickleKind::kGlobal:
      return "global " + std::string(global_module()) + "." + std::string(global_name());
    case PickleKind::kReduce:
    case PickleKind::kNewObj: {
      const PickleValue c = callable();
      if (c.is(PickleKind::kGlobal)) return name + " of " + c.Describe();
      return name;
    }
    case PickleKind::kPersId:
      return name;
  }
  return name;
}

namespace {
Status Expected(std::string_view what, const PickleValue& v) {
  return InvalidArgument("expected " + std::string(what) + ", found " + v.Describe());
}
}  // namespace

Result<int64_t> PickleValue::AsInt() const {
  const PickleKind k = kind();
  if (k == PickleKind::kInt || k == PickleKind::kBool) return tree_->payload(id_).i;
  if (k == PickleKind::kBigInt) return InvalidArgument("integer beyond 64 bits");
  return Expected("an int", *this);
}

Result<bool> PickleValue::AsBool() const {
  if (kind() == PickleKind::kBool) return tree_->payload(id_).i != 0;
  return Expected("a bool", *this);
}

Result<double> PickleValue::AsFloat() const {
  const PickleKind k = kind();
  if (k == PickleKind::kFloat) return tree_->payload(id_).f;
  if (k == PickleKind::kInt) return static_cast<double>(tree_->payload(id_).i);
  return Expected("a float", *this);
}

Result<std::string_view> PickleValue::AsStr() const {
  if (kind() == PickleKind::kStr) return tree_->Text(id_);
  return Expected("a str", *this);
}

Result<std::string_view> PickleValue::AsBytes() const {
  const PickleKind k = kind();
  if (k == PickleKind::kBytes || k == PickleKind::kByteArray) return tree_->Text(id_);
  return Expected("bytes", *this);
}

std::string_view PickleValue::BigIntBytes() const {
  return kind() == PickleKind::kBigInt ? tree_->Text(id_) : std::string_view();
}

size_t PickleValue::size() const {
  switch (kind()) {
    case PickleKind::kTuple:
    case PickleKind::kList:
    case PickleKind::kSet:
      return tree_->payload(id_).p.count;
    case PickleKind::kDict:
      return tree_->payload(id_).p.count / 2;
    default:
      return 0;
  }
}

// Accessors used on the wrong kind or out of range return None (or ""), never read out of
// bounds: the interpretation code checks kinds, and this keeps a slip from being a crash.
PickleValue PickleValue::item(size_t i) const {
  const PickleKind k = kind();
  const bool sequence = k == PickleKind::kTuple || k == PickleKind::kList || k == PickleKind::kSet;
  if (!sequence || i >= tree_->payload(id_).p.count) return PickleValue(tree_, kNoneId);
  return tree_->Child(id_, i);
}
PickleValue PickleValue::key(size_t i) const {
  if (kind() != PickleKind::kDict || i >= size()) return PickleValue(tree_, kNoneId);
  return tree_->Child(id_, 2 * i);
}
PickleValue PickleValue::value(size_t i) const {
  if (kind() != PickleKind::kDict || i >= size()) return PickleValue(tree_, kNoneId);
  return tree_->Child(id_, 2 * i + 1);
}

std::optional<PickleValue> PickleValue::Find(std::string_view key_str) const {
  if (!is(PickleKind::kDict)) return std::nullopt;
  const size_t n = size();
  for (size_t i = 0; i < n; ++i) {
    const PickleValue k = key(i);
    if (k.is(PickleKind::kStr) && tree_->Text(k.id_) == key_str) return value(i);
  }
  return std::nullopt;
}

Result<PickleValue> PickleValue::ExpectTuple(size_t n) const {
  if ((is(PickleKind::kTuple) || is(PickleKind::kList)) && size() == n) return *this;
  return Expected("a tuple of " + std::to_string(n), *this);
}

Result<PickleValue> PickleValue::ExpectKind(PickleKind k) const {
  if (is(k)) return *this;
  return Expected("a " + std::string(PickleKindName(k)), *this);
}

std::string_view PickleValue::global_module() const {
  if (kind() != PickleKind::kGlobal) return {};
  return tree_->Text(tree_->Child(id_, 0).id_);
}

std::string_view PickleValue::global_name() const {
  if (kind() != PickleKind::kGlobal) return {};
  return tree_->Text(tree_->Child(id_, 1).id_);
}

namespace {
bool IsObject(PickleKind k) { return k == PickleKind::kReduce || k == PickleKind::kNewObj; }
}  // namespace

PickleValue PickleValue::callable() const {
  return IsObject(kind()) ? tree_->Child(id_, 0) : PickleValue(tree_, kNoneId);
}
PickleValue PickleValue::args() const {
  return IsObject(kind()) ? tree_->Child(id_, 1) : PickleValue(tree_, kNoneId);
}
std::optional<PickleValue> PickleValue::kwargs() const {
  if (kind() != PickleKind::kNewObj || tree_->payload(id_).p.count < 3) return std::nullopt;
  return tree_->Child(id_, 2);
}

std::optional<PickleValue> PickleValue::Extra(int which) const {
  if (!IsObject(kind())) return std::nullopt;
  const uint32_t index = tree_->ObjectExtraIndex(id_);
  if (index == PickleTree::kNoIndex) return std::nullopt;
  const PickleTree::ObjectExtra& e = tree_->objects_[index];
  const uint32_t id = which == 0 ? e.state : which == 1 ? e.list_items : e.dict_items;
  if (id == PickleTree::kNoIndex) return std::nullopt;
  return PickleValue(tree_, id);
}
std::optional<PickleValue> PickleValue::state() const { return Extra(0); }
std::optional<PickleValue> PickleValue::list_items() const { return Extra(1); }
std::optional<PickleValue> PickleValue::dict_items() const { return Extra(2); }

std::optional<PickleValue> PickleValue::ObjectClass() const {
  if (!is(PickleKind::kReduce) && !is(PickleKind::kNewObj)) return std::nullopt;
  const PickleValue c = callable();
  if (!c.is(PickleKind::kGlobal)) return std::nullopt;
  if (is(PickleKind::kReduce) &&
      (c.IsGlobal("copyreg", "_reconstructor") || c.IsGlobal("copy_reg", "_reconstructor"))) {
    const PickleValue a = args();
    if (a.size() >= 1 && a.item(0).is(PickleKind::kGlobal)) return a.item(0);
    return std::nullopt;
  }
  return c;
}

bool PickleValue::IsObjectOf(std::string_view module, std::string_view name) const {
  const std::optional<PickleValue> cls = ObjectClass();
  return cls && cls->IsGlobal(module, name);
}

std::optional<PickleValue> PickleValue::Attr(std::string_view name) const {
  const std::optional<PickleValue> s = state();
  if (!s) return std::nullopt;
  if (s->is(PickleKind::kDict)) return s->Find(name);
  if (s->is(PickleKind::kTuple) && s->size() == 2) {  // (dict or None, slots dict or None)
    if (auto v = s->item(0).Find(name)) return v;
    return s->item(1).Find(name);
  }
  return std::nullopt;
}

PickleValue PickleValue::persistent_id() const {
  return kind() == PickleKind::kPersId ? tree_->Child(id_, 0) : PickleValue(tree_, kNoneId);
}

// ---- bytes objects --------------------------------------------------------------------------

namespace {
// Python's str.encode('latin1') of UTF-8 text: every code point must be below 256.
Result<std::string> Latin1FromUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if ((c == 0xC2 || c == 0xC3) && i + 1 < s.size() &&
               (static_cast<uint8_t>(s[i + 1]) & 0xC0) == 0x80) {
      out.push_back(static_cast<char>(((c & 0x03) << 6) | (static_cast<uint8_t>(s[i + 1]) & 0x3F)));
      ++i;
    } else {
      return InvalidArgument("text is not latin-1 (byte 0x" + HexByte(c) + " at " +
                             std::to_string(i) + ")");
    }
  }
  return out;
}
}  // namespace

Result<std::string> DecodePickledBytes(PickleValue value) {
  if (value.is(PickleKind::kBytes) || value.is(PickleKind::kByteArray)) {
    TESSERA_ASSIGN_OR_RETURN(std::string_view b, value.AsBytes());
    return std::string(b);
  }
  if (value.is(PickleKind::kReduce)) {
    const PickleValue f = value.callable();
    const PickleValue a = value.args();
    if (f.IsGlobal("_codecs", "encode") && a.size() == 2) {
      TESSERA_ASSIGN_OR_RETURN(std::string_view text, a.item(0).AsStr());
      TESSERA_ASSIGN_OR_RETURN(std::string_view encoding, a.item(1).AsStr());
      if (encoding != "latin1" && encoding != "latin-1") {
        return InvalidArgument("_codecs.encode with encoding '" + std::string(encoding) +
                               "', expected 'latin1'");
      }
      return Latin1FromUtf8(text);
    }
    const bool bytes_type = f.IsGlobal("__builtin__", "bytes") || f.IsGlobal("builtins", "bytes");
    const bool bytearray_type =
        f.IsGlobal("__builtin__", "bytearray") || f.IsGlobal("builtins", "bytearray");
    if ((bytes_type || bytearray_type) && a.size() == 0) return std::string();
    if (bytearray_type && a.size() >= 1) {
      // Protocol 2 bytearray: bytearray(str, 'latin-1'); protocol 3/4: bytearray(bytes).
      if (a.item(0).is(PickleKind::kStr)) {
        TESSERA_ASSIGN_OR_RETURN(std::string_view text, a.item(0).AsStr());
        return Latin1FromUtf8(text);
      }
      return DecodePickledBytes(a.item(0));
    }
  }
  return InvalidArgument("expected a bytes object, found " + value.Describe());
}

}  // namespace tessera::torch_dist
