// Emits pickle opcodes, byte for byte as CPython's pickle.Pickler would for the same values
// (integers, strings, tuples), so that what tessera writes for torch matches what torch writes.
// The caller drives the stack machine: push values, then the opcode that consumes them.
//
// Protocol 2 (what torch.save uses for data.pkl) or 4 (what pickle.dump uses by default for a
// DCP .metadata). No FRAME opcodes are written: they are optional for every unpickler.
#ifndef TESSERA_FORMAT_TORCH_DIST_PICKLE_WRITER_H_
#define TESSERA_FORMAT_TORCH_DIST_PICKLE_WRITER_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tessera::torch_dist {

class PickleWriter {
 public:
  // `protocol` is 2 or 4.
  explicit PickleWriter(int protocol);

  int protocol() const { return protocol_; }
  std::vector<uint8_t>& bytes() { return out_; }
  std::vector<uint8_t> Take() { return std::move(out_); }

  // Values (each pushes one item).
  void None() { Op(0x4E); }
  void Bool(bool v) { Op(v ? 0x88 : 0x89); }
  void Int(int64_t v);  // BININT1 / BININT2 / BININT / LONG1, as save_long
  void Float(double v);
  void Str(std::string_view utf8);  // SHORT_BINUNICODE (protocol 4, < 256 bytes) / BINUNICODE(8)
  void Bytes(std::span<const uint8_t> b);  // protocol 4 only: SHORT_BINBYTES / BINBYTES(8)
  // GLOBAL "module\nname\n" (protocol 2), or module and name strings + STACK_GLOBAL (4).
  // (Neither memoizes; see GlobalMemo.)
  void Global(std::string_view module, std::string_view name);
  void EmptyTuple() { Op(0x29); }
  void EmptyList() { Op(0x5D); }
  void EmptyDict() { Op(0x7D); }
  // A tuple of ints, as save_tuple: EMPTY_TUPLE, TUPLE1-3, or MARK ... TUPLE (not memoized).
  void IntTuple(std::span<const int64_t> values);

  // Opcodes that consume the stack.
  void Mark() { Op(0x28); }
  void Tuple() { Op(0x74); }  // MARK ... TUPLE
  void Tuple1() { Op(0x85); }
  void Tuple2() { Op(0x86); }
  void Tuple3() { Op(0x87); }
  void Append() { Op(0x61); }
  void Appends() { Op(0x65); }  // MARK ... APPENDS
  void SetItem() { Op(0x73); }
  void SetItems() { Op(0x75); }  // MARK ... SETITEMS
  void Reduce() { Op(0x52); }
  void NewObj() { Op(0x81); }
  void Build() { Op(0x62); }
  void BinPersId() { Op(0x51); }
  void Pop() { Op(0x30); }
  void Stop() { Op(0x2E); }

  // The memo. Memoize() stores the top of the stack under the next index (MEMOIZE in protocol
  // 4, BINPUT / LONG_BINPUT in 2) and returns that index; Get pushes it again (BINGET for
  // indices below 256, else LONG_BINGET).
  uint32_t Memoize();
  void Get(uint32_t index);
  uint32_t memo_size() const { return next_memo_; }

  // Pushes a string or global, memoized on first use and fetched with Get afterwards. The first
  // use of a global also memoizes its module and name strings (protocol 4).
  void StrMemo(std::string_view s);
  void GlobalMemo(std::string_view module, std::string_view name);
  // Memoizes a string or global now, leaving the stack as it was (push, MEMOIZE, POP), so that
  // the frequent ones get 1-byte memo indices before anything else uses the memo.
  void Preload(std::string_view s);
  void PreloadGlobal(std::string_view module, std::string_view name);

 private:
  void Op(uint8_t op) { out_.push_back(op); }
  void U8(uint8_t v) { out_.push_back(v); }
  void LE(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void Raw(std::string_view s) { out_.insert(out_.end(), s.begin(), s.end()); }

  int protocol_;
  std::vector<uint8_t> out_;
  uint32_t next_memo_ = 0;
  std::unordered_map<std::string, uint32_t> strings_;  // memoized strings
  std::unordered_map<std::string, uint32_t> globals_;  // "module\nname" -> memo index
};

}  // namespace tessera::torch_dist

#endif  // TESSERA_FORMAT_TORCH_DIST_PICKLE_WRITER_H_
