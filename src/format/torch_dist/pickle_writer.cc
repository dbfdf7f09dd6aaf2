#include "format/torch_dist/pickle_writer.h"

#include <cstring>

namespace tessera::torch_dist {

PickleWriter::PickleWriter(int protocol) : protocol_(protocol) {
  Op(0x80);  // PROTO
  U8(static_cast<uint8_t>(protocol));
}

void PickleWriter::Int(int64_t v) {
  if (v >= 0 && v <= 0xFF) {
    Op(0x4B);  // BININT1
    U8(static_cast<uint8_t>(v));
  } else if (v >= 0 && v <= 0xFFFF) {
    Op(0x4D);  // BININT2
    LE(static_cast<uint64_t>(v), 2);
  } else if (v >= -0x80000000LL && v <= 0x7FFFFFFFLL) {
    Op(0x4A);  // BININT
    LE(static_cast<uint64_t>(v), 4);
  } else {
    // LONG1 with pickle.encode_long's bytes: the shortest little-endian two's complement.
    uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
    int n = 8;
    while (n > 1) {
      const uint8_t top = b[n - 1], next = b[n - 2];
      if ((top == 0x00 && !(next & 0x80)) || (top == 0xFF && (next & 0x80))) {
        --n;
      } else {
        break;
      }
    }
    Op(0x8A);
    U8(static_cast<uint8_t>(n));
    out_.insert(out_.end(), b, b + n);
  }
}

void PickleWriter::Float(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  Op(0x47);  // BINFLOAT, big-endian
  for (int i = 7; i >= 0; --i) U8(static_cast<uint8_t>(bits >> (8 * i)));
}

void PickleWriter::Str(std::string_view utf8) {
  const uint64_t n = utf8.size();
  if (protocol_ >= 4 && n <= 0xFF) {
    Op(0x8C);
    U8(static_cast<uint8_t>(n));
  } else if (protocol_ >= 4 && n > 0xFFFFFFFFu) {
    Op(0x8D);
    LE(n, 8);
  } else {
    Op(0x58);
    LE(n, 4);
  }
  Raw(utf8);
}

void PickleWriter::Bytes(std::span<const uint8_t> b) {
  const uint64_t n = b.size();
  if (n <= 0xFF) {
    Op(0x43);
    U8(static_cast<uint8_t>(n));
  } else if (n <= 0xFFFFFFFFu) {
    Op(0x42);
    LE(n, 4);
  } else {
    Op(0x8E);
    LE(n, 8);
  }
  out_.insert(out_.end(), b.begin(), b.end());
}

void PickleWriter::Global(std::string_view module, std::string_view name) {
  if (protocol_ >= 4) {
    Str(module);
    Str(name);
    Op(0x93);  // STACK_GLOBAL
    return;
  }
  Op(0x63);  // GLOBAL
  Raw(module);
  U8('\n');
  Raw(name);
  U8('\n');
}

void PickleWriter::IntTuple(std::span<const int64_t> values) {
  if (values.empty()) {
    EmptyTuple();
    return;
  }
  if (values.size() > 3) Mark();
  for (int64_t v : values) Int(v);
  switch (values.size()) {
    case 1:
      Tuple1();
      break;
    case 2:
      Tuple2();
      break;
    case 3:
      Tuple3();
      break;
    default:
      Tuple();
      break;
  }
}

uint32_t PickleWriter::Memoize() {
  const uint32_t index = next_memo_++;
  if (protocol_ >= 4) {
    Op(0x94);  // MEMOIZE
  } else if (index <= 0xFF) {
    Op(0x71);  // BINPUT
    U8(static_cast<uint8_t>(index));
  } else {
    Op(0x72);  // LONG_BINPUT
    LE(index, 4);
  }
  return index;
}

void PickleWriter::Get(uint32_t index) {
  if (index <= 0xFF) {
    Op(0x68);  // BINGET
    U8(static_cast<uint8_t>(index));
  } else {
    Op(0x6A);  // LONG_BINGET
    LE(index, 4);
  }
}

void PickleWriter::StrMemo(std::string_view s) {
  auto it = strings_.find(std::string(s));
  if (it != strings_.end()) {
    Get(it->second);
    return;
  }
  Str(s);
  strings_.emplace(std::string(s), Memoize());
}

void PickleWriter::GlobalMemo(std::string_view module, std::string_view name) {
  std::string key = std::string(module) + "\n" + std::string(name);
  auto it = globals_.find(key);
  if (it != globals_.end()) {
    Get(it->second);
    return;
  }
  if (protocol_ >= 4) {
    StrMemo(module);
    StrMemo(name);
    Op(0x93);  // STACK_GLOBAL
  } else {
    Global(module, name);
  }
  globals_.emplace(std::move(key), Memoize());
}

void PickleWriter::Preload(std::string_view s) {
  if (strings_.count(std::string(s))) return;
  StrMemo(s);
  Pop();
}

void PickleWriter::PreloadGlobal(std::string_view module, std::string_view name) {
  if (globals_.count(std::string(module) + "\n" + std::string(name))) return;
  GlobalMemo(module, name);
  Pop();
}

}  // namespace tessera::torch_dist
