// A restricted, inert pickle reader: parses Python pickles (protocols 2 to 5, plus the
// protocol 0 and 1 opcodes such streams contain) into a tree of nodes WITHOUT importing or
// calling anything. What Python would execute becomes a record:
//
//   GLOBAL / STACK_GLOBAL        -> global(module, name)
//   REDUCE                       -> reduce(callable, args)
//   NEWOBJ / NEWOBJ_EX           -> newobj(cls, args[, kwargs])
//   BUILD                        -> the object's `state` (a second BUILD on one object is an error)
//   APPEND(S) / SETITEM(S) on an object (a list or dict subclass) -> its list_items / dict_items
//   PERSID / BINPERSID           -> persid(pid)
//
// A dict that would hold one key twice (a key repeated by SETITEM(S), which Python resolves by
// keeping the last value) and a BUILD whose (dict, slots) state names one attribute in both are
// refused (kDataLoss naming the key): tessera never reads such a stream with a meaning that
// could differ from Python's. Keys compare as Python's do for str, bytes and numbers
// (1 == True == 1.0).
//
// The memo (PUT/BINPUT/LONG_BINPUT/MEMOIZE, GET/BINGET/LONG_BINGET) shares nodes, so an object
// referenced twice is one node and mutations made through either reference are seen by both
// (as in Python). Sets and frozensets are sequences like lists. Out-of-band buffers
// (NEXT_BUFFER, READONLY_BUFFER), the copyreg extension registry (EXT1/2/4) and the text
// opcodes whose escapes would need decoding (STRING, UNICODE, INST, OBJ) are errors.
//
// Memory is linear in the input and small: 9 bytes per value-creating opcode (a kind byte and
// an 8-byte payload, kept in arrays that grow by blocks and so are never copied; None, bools,
// the empty tuple and ints 0..255 are shared constants), 4 bytes per container child (one more
// per object, for its BUILD and items), 4 bytes per stack entry, mark and memo slot. At worst
// (a stream of 1-byte opcodes that each create a container) that is 13 bytes per input byte
// besides the input itself; a real DCP .metadata takes about 3 (docs/FORMAT_TORCH_DIST.md). The
// parser is iterative (no recursion, whatever the nesting). Strings and bytes are views into
// the input, which must outlive the tree. Inputs of 4 GiB or more are refused.
//
// Errors are kDataLoss: "<source>: pickle: <what> at offset <n> (opcode <NAME> 0x<hex>)".
//
// Thread safety: a PickleTree is immutable after ParsePickle; concurrent readers are fine.
#ifndef TESSERA_FORMAT_TORCH_DIST_PICKLE_H_
#define TESSERA_FORMAT_TORCH_DIST_PICKLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/status.h"

namespace tessera::torch_dist {

enum class PickleKind : uint8_t {
  kNone,
  kBool,
  kInt,     // fits in int64
  kBigInt,  // LONG1/LONG4 beyond int64: little-endian two's complement bytes (BigIntBytes)
  kFloat,
  kStr,        // UTF-8 bytes as stored (BINUNICODE*, and py2 BINSTRING/SHORT_BINSTRING)
  kBytes,      // BINBYTES*
  kByteArray,  // BYTEARRAY8
  kTuple,
  kList,
  kDict,
  kSet,     // set and frozenset
  kGlobal,  // module, name
  kReduce,  // callable, args
  kNewObj,  // cls, args[, kwargs]
  kPersId,  // persistent id
};
std::string_view PickleKindName(PickleKind kind);

class PickleTree;

// A handle on one node: a tree pointer and an index. Cheap to copy; valid while the tree is.
// Accessors that can fail return Result with an error describing what was found instead
// ("expected an int, found tuple of 2"); callers add where they were looking.
class PickleValue {
 public:
  PickleValue() = default;
  PickleValue(const PickleTree* tree, uint32_t id) : tree_(tree), id_(id) {}

  PickleKind kind() const;
  uint32_t id() const { return id_; }
  bool is(PickleKind k) const { return kind() == k; }
  bool is_none() const { return is(PickleKind::kNone); }
  // A global with exactly this module and name.
  bool IsGlobal(std::string_view module, std::string_view name) const;
  // "int 5", "str 'abc'", "tuple of 3", "global torch.Size", "newobj of global a.B", ...: for
  // error messages; strings are shortened.
  std::string Describe() const;

  // Scalars. AsInt accepts bools (Python's bool is an int); AsFloat accepts ints.
  Result<int64_t> AsInt() const;
  Result<bool> AsBool() const;
  Result<double> AsFloat() const;
  Result<std::string_view> AsStr() const;
  Result<std::string_view> AsBytes() const;  // bytes or bytearray
  // kBigInt only: the little-endian two's complement bytes.
  std::string_view BigIntBytes() const;

  // Sequences (tuple, list, set) and dicts. size() is the number of items (of key/value pairs
  // for a dict), 0 for other kinds.
  size_t size() const;
  // Item i of a tuple/list/set (requires i < size()).
  PickleValue item(size_t i) const;
  // Key and value of pair i of a dict (requires i < size()).
  PickleValue key(size_t i) const;
  PickleValue value(size_t i) const;
  // The value of the first pair of a dict whose key is the str `key`; nullopt when absent or
  // when this is not a dict.
  std::optional<PickleValue> Find(std::string_view key) const;
  // A tuple (or list) of exactly `n` items, else an error naming what was found.
  Result<PickleValue> ExpectTuple(size_t n) const;
  Result<PickleValue> ExpectKind(PickleKind k) const;

  // Global: module and name.
  std::string_view global_module() const;
  std::string_view global_name() const;

  // Reduce / newobj: callable (or cls), args, kwargs (NEWOBJ_EX only).
  PickleValue callable() const;
  PickleValue args() const;
  std::optional<PickleValue> kwargs() const;
  // Set by BUILD, APPEND(S), SETITEM(S) on the object.
  std::optional<PickleValue> state() const;
  std::optional<PickleValue> list_items() const;
  std::optional<PickleValue> dict_items() const;

  // The class of an object record: the cls of a newobj, the callable of a reduce, or cls for
  // the protocol-0/1 form reduce(copyreg._reconstructor, (cls, base, state)). nullopt when that
  // is not a global.
  std::optional<PickleValue> ObjectClass() const;
  // An object record whose class is the global module.name.
  bool IsObjectOf(std::string_view module, std::string_view name) const;
  // An attribute from the object's state: a dict state, or the (dict, slots dict) pair that
  // classes with __slots__ produce. nullopt when absent.
  std::optional<PickleValue> Attr(std::string_view name) const;

  // Persistent id: the pid value.
  PickleValue persistent_id() const;

 private:
  // 0: state, 1: list_items, 2: dict_items.
  std::optional<PickleValue> Extra(int which) const;
  const PickleTree* tree_ = nullptr;
  uint32_t id_ = 0;
};

class PickleTree {
 public:
  PickleTree() = default;
  PickleTree(PickleTree&&) = default;
  PickleTree& operator=(PickleTree&&) = default;

  PickleValue root() const { return PickleValue(this, root_); }
  // Bytes consumed up to and including STOP (pickle.load ignores what follows).
  uint64_t end_offset() const { return end_offset_; }
  size_t node_count() const { return kinds_.size(); }
  // The memory the tree holds, without the input.
  size_t memory_bytes() const {
    return kinds_.memory_bytes() + payloads_.memory_bytes() + children_.memory_bytes() +
           objects_.capacity() * sizeof(ObjectExtra);
  }
  const std::string& source() const { return source_; }
  // The offset of the opcode that created `value` (for error messages: found by parsing the
  // input again up to that node, with the memory of a parse at most); nullopt for the shared
  // constants (None, bools, the empty tuple, ints 0..255).
  std::optional<uint64_t> OffsetOf(const PickleValue& value) const;

 private:
  friend class PickleValue;
  friend class PickleParser;
  friend Result<PickleTree> ParsePickle(std::vector<uint8_t>&& bytes, std::string_view source);

  // An array that grows by blocks of 2^16 elements: what it holds never moves, so growing it
  // never holds an old and a new copy at once (a vector's doubling does, for a moment, which
  // was the parser's peak memory).
  template <typename T>
  class BlockArray {
   public:
    size_t size() const { return size_; }
    T& operator[](size_t i) { return blocks_[i >> kShift][i & kMask]; }
    const T& operator[](size_t i) const { return blocks_[i >> kShift][i & kMask]; }
    void push_back(const T& v) {
      if ((size_ & kMask) == 0) blocks_.push_back(std::make_unique<T[]>(kBlock));
      blocks_.back()[size_ & kMask] = v;
      ++size_;
    }
    void append(const T* first, size_t n) {
      for (size_t i = 0; i < n; ++i) push_back(first[i]);
    }
    size_t memory_bytes() const { return blocks_.size() * kBlock * sizeof(T); }

   private:
    static constexpr size_t kShift = 16, kBlock = size_t{1} << kShift, kMask = kBlock - 1;
    std::vector<std::unique_ptr<T[]>> blocks_;
    size_t size_ = 0;
  };

  // What a node holds besides its kind (kept apart: 9 bytes a node, not 16).
  union Payload {
    int64_t i;  // kInt, kBool
    double f;   // kFloat
    struct {
      // kStr/kBytes/kByteArray/kBigInt: offset of the bytes in the input; containers, globals,
      // objects, persid: first child in children_ (while parsing, a list, dict or set: its
      // first segment of children, or kNoIndex).
      uint32_t a;
      // Bytes of a string; children of a container (2 per dict pair); parts of an object (2,
      // or 3 for NEWOBJ_EX), whose children_ hold one more slot after them: the index of its
      // ObjectExtra in objects_, or kNoIndex.
      uint32_t count;
    } p;
  };
  struct ObjectExtra {
    uint32_t state, list_items, dict_items;
  };
  static constexpr uint32_t kNoIndex = 0xFFFFFFFFu;

  PickleKind kind(uint32_t id) const { return static_cast<PickleKind>(kinds_[id]); }
  const Payload& payload(uint32_t id) const { return payloads_[id]; }
  std::string_view Text(uint32_t id) const {
    const Payload& n = payloads_[id];
    return std::string_view(reinterpret_cast<const char*>(data_) + n.p.a, n.p.count);
  }
  PickleValue Child(uint32_t id, size_t i) const {
    return PickleValue(this, children_[payloads_[id].p.a + i]);
  }
  uint32_t ObjectExtraIndex(uint32_t id) const {
    const Payload& n = payloads_[id];
    return children_[n.p.a + n.p.count];
  }

  const uint8_t* data_ = nullptr;
  std::vector<uint8_t> owned_;  // the input, when the tree owns it (moving keeps its buffer)
  BlockArray<uint8_t> kinds_;   // PickleKind of each node
  BlockArray<Payload> payloads_;
  BlockArray<uint32_t> children_;
  std::vector<ObjectExtra> objects_;
  uint32_t root_ = 0;
  uint64_t end_offset_ = 0;
  std::string source_;
};

// Parses the pickle at the start of `bytes` (up to its STOP opcode). `bytes` must outlive the
// tree (strings are views into it). `source` names the input in errors (a file path).
Result<PickleTree> ParsePickle(std::span<const uint8_t> bytes, std::string_view source);
// The same, with the tree owning the bytes (a temporary vector binds here, so its views stay
// valid).
Result<PickleTree> ParsePickle(std::vector<uint8_t>&& bytes, std::string_view source);

// The bytes of a pickled Python `bytes` object, in any of the encodings Python uses:
// BINBYTES* / BYTEARRAY8 (protocol 3+), reduce(_codecs.encode, (str, "latin1")) (protocol 2),
// reduce(__builtin__.bytes or builtins.bytes, ()) for b"" (protocol 2), and
// reduce(builtins.bytearray, (...)) forms of the same. Errors describe what was found.
Result<std::string> DecodePickledBytes(PickleValue value);

}  // namespace tessera::torch_dist

#endif  // TESSERA_FORMAT_TORCH_DIST_PICKLE_H_
