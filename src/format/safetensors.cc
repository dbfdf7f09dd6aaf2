#include "format/safetensors.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>
#include <numeric>
#include <string_view>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/utf8.h"

namespace tessera {

namespace {

constexpr std::string_view kMetadataKey = "__metadata__";

void AppendJsonString(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  size_t run = 0;  // start of the pending run of bytes that need no escaping
  for (size_t i = 0; i < s.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out.append(s.data() + run, i - run);
    run = i + 1;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        out += "\\u00";
        out.push_back(kHex[c >> 4]);
        out.push_back(kHex[c & 0xF]);
    }
  }
  out.append(s.data() + run, s.size() - run);
  out.push_back('"');
}

template <typename T>
void AppendInt(std::string& out, T value) {
  char buf[24];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  out.append(buf, ptr);
}

// Elements * bytes per element, or false on overflow / negative dimension.
bool EntryBytes(const Shape& shape, DType dtype, uint64_t* bytes) {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *bytes = n;
  return true;
}

std::string Quote(std::string_view s) {
  std::string out;
  AppendJsonString(out, s);
  return out;
}

// The dtypes of the safetensors format (its Rust `Dtype` and the Python bindings' names, as of
// safetensors 0.8) that tessera has no DType for: complex64, the FNUZ float8s, the MX scale
// float8 and the sub-byte floats (whose shape counts elements, not bytes).
bool IsSafetensorsOnlyDType(std::string_view name) {
  static constexpr std::string_view kNames[] = {"C64", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0",
                                                "F4",  "F6_E2M3",     "F6_E3M2"};
  for (std::string_view n : kNames) {
    if (n == name) return true;
  }
  return false;
}

// SAX handler for a safetensors header: builds the entries in header order and rejects
// anything a strict reader would (duplicates, unknown fields, wrong types).
class HeaderParser {
 public:
  using json = nlohmann::json;
  using number_integer_t = json::number_integer_t;
  using number_unsigned_t = json::number_unsigned_t;
  using number_float_t = json::number_float_t;
  using string_t = json::string_t;
  using binary_t = json::binary_t;

  explicit HeaderParser(SafetensorsHeader* out) : out_(out) {}

  const std::string& error() const { return error_; }
  // True when parsing stopped at a dtype safetensors defines and tessera lacks.
  bool unsupported() const { return unsupported_; }

  bool null() { return Unexpected("null"); }
  bool boolean(bool) { return Unexpected("a boolean"); }
  bool number_integer(number_integer_t v) {
    if (v >= 0) return number_unsigned(static_cast<number_unsigned_t>(v));
    return Fail(Where() + "negative number " + std::to_string(v));
  }
  bool number_unsigned(number_unsigned_t v) {
    if (depth_ != 3) return Unexpected("a number");
    SafetensorsEntry& e = out_->entries.back();
    if (field_ == Field::kShape) {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Fail(Where() + "shape dimension " + std::to_string(v) + " is too large");
      }
      e.shape.push_back(static_cast<int64_t>(v));
      return true;
    }
    if (field_ == Field::kOffsets) {
      if (num_offsets_ == 0) {
        e.begin = v;
      } else if (num_offsets_ == 1) {
        e.end = v;
      } else {
        return Fail(Where() + "data_offsets has more than 2 numbers");
      }
      ++num_offsets_;
      return true;
    }
    return Unexpected("a number");
  }
  bool number_float(number_float_t, const string_t& s) {
    return Fail(Where() + "number " + s + " is not a non-negative integer (or is too large)");
  }
  bool string(string_t& s) {
    if (depth_ == 2 && in_metadata_) {
      out_->metadata[meta_key_] = s;
      return true;
    }
    if (depth_ == 2 && field_ == Field::kDtype) {
      auto dtype = DTypeFromName(s);
      if (!dtype.ok()) {
        // A dtype of the safetensors format that tessera does not hold is a valid file
        // tessera cannot read (Unimplemented), not a damaged one.
        unsupported_ = IsSafetensorsOnlyDType(s);
        return Fail(Where() + "dtype " + Quote(s) + " is not supported");
      }
      out_->entries.back().dtype = *dtype;
      return true;
    }
    return Unexpected("a string");
  }
  bool binary(binary_t&) { return Unexpected("binary data"); }

  bool start_object(size_t) {
    ++depth_;
    if (depth_ == 1) return true;
    if (depth_ == 2) return true;  // the entry's or __metadata__'s object (checked in key())
    return Unexpected("an object");
  }
  bool end_object() {
    if (depth_ == 2 && !in_metadata_) {
      if (seen_ != 7) {
        std::string missing;
        if (!(seen_ & 1)) missing += " dtype";
        if (!(seen_ & 2)) missing += " shape";
        if (!(seen_ & 4)) missing += " data_offsets";
        return Fail(Where() + "missing field(s):" + missing);
      }
    }
    if (depth_ == 2) in_metadata_ = false;
    --depth_;
    field_ = Field::kNone;
    return true;
  }
  bool start_array(size_t) {
    if (depth_ != 2 || in_metadata_ || (field_ != Field::kShape && field_ != Field::kOffsets)) {
      return Unexpected("an array");
    }
    ++depth_;
    num_offsets_ = 0;
    return true;
  }
  bool end_array() {
    if (field_ == Field::kOffsets && num_offsets_ != 2) {
      return Fail(Where() + "data_offsets must hold exactly 2 numbers");
    }
    --depth_;
    field_ = Field::kNone;
    return true;
  }
  bool key(string_t& k) {
    if (depth_ == 1) {
      if (!names_.insert(k).second) return Fail("duplicate entry " + Quote(k));
      name_ = k;
      if (k == kMetadataKey) {
        in_metadata_ = true;
        return true;
      }
      out_->entries.emplace_back();
      out_->entries.back().name = k;
      seen_ = 0;
      return true;
    }
    if (depth_ == 2 && in_metadata_) {
      meta_key_ = k;
      if (out_->metadata.count(k)) return Fail("__metadata__: duplicate key " + Quote(k));
      return true;
    }
    if (depth_ == 2) {
      int bit;
      if (k == "dtype") {
        field_ = Field::kDtype, bit = 1;
      } else if (k == "shape") {
        field_ = Field::kShape, bit = 2;
      } else if (k == "data_offsets") {
        field_ = Field::kOffsets, bit = 4;
      } else {
        return Fail(Where() + "unknown field " + Quote(k));
      }
      if (seen_ & bit) return Fail(Where() + "duplicate field " + Quote(k));
      seen_ |= bit;
      return true;
    }
    return Unexpected("a key");
  }
  bool parse_error(size_t position, const std::string&, const nlohmann::detail::exception& ex) {
    if (error_.empty()) {
      error_ = "invalid JSON at byte " + std::to_string(position) + ": " + ex.what();
    }
    return false;
  }

 private:
  enum class Field { kNone, kDtype, kShape, kOffsets };

  std::string Where() const {
    if (depth_ <= 1) return "";
    if (in_metadata_) return "__metadata__: ";
    return "entry " + Quote(name_) + ": ";
  }
  bool Unexpected(const std::string& what) {
    if (depth_ == 0) return Fail("header is not a JSON object");
    if (in_metadata_) return Fail("__metadata__: must map strings to strings, found " + what);
    if (depth_ == 1) return Fail("entry " + Quote(name_) + ": must be an object, found " + what);
    const char* field = field_ == Field::kDtype   ? "dtype"
                        : field_ == Field::kShape ? "shape"
                                                  : "data_offsets";
    return Fail(Where() + "field " + field + ": did not expect " + what);
  }
  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }

  SafetensorsHeader* out_;
  std::unordered_set<std::string> names_;
  std::string name_;
  std::string meta_key_;
  std::string error_;
  int depth_ = 0;
  bool in_metadata_ = false;
  bool unsupported_ = false;
  Field field_ = Field::kNone;
  int seen_ = 0;  // bits: 1 dtype, 2 shape, 4 data_offsets
  int num_offsets_ = 0;
};

}  // namespace

std::string ChunkEntryName(const std::string& key, const Box& box, const Shape& global_shape) {
  bool whole = box.sizes == global_shape;
  for (int64_t o : box.offsets) whole = whole && o == 0;
  if (whole) return key;
  std::string name;
  name.reserve(key.size() + 1 + 8 * box.offsets.size());
  name += key;
  name.push_back('@');
  for (size_t d = 0; d < box.offsets.size(); ++d) {
    if (d) name.push_back(',');
    AppendInt(name, box.offsets[d]);
  }
  return name;
}

uint64_t LayOutEntries(std::vector<SafetensorsEntry>& entries) {
  uint64_t pos = 0;
  for (SafetensorsEntry& e : entries) {
    uint64_t n = DTypeSize(e.dtype);
    for (int64_t d : e.shape) n *= static_cast<uint64_t>(d);
    e.begin = pos;
    e.end = pos + n;
    pos = e.end;
  }
  return pos;
}

Result<Bytes> EncodeSafetensorsHeader(std::span<const SafetensorsEntry> entries,
                                      const std::map<std::string, std::string>& metadata) {
  std::string json;
  size_t estimate = 2;
  for (const SafetensorsEntry& e : entries) estimate += e.name.size() + 64 + 12 * e.shape.size();
  for (const auto& [k, v] : metadata) estimate += k.size() + v.size() + 8;
  json.reserve(estimate + 32);

  json.push_back('{');
  bool first = true;
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (!IsValidUtf8(k) || !IsValidUtf8(v)) {
        return InvalidArgument("safetensors __metadata__ entry " + Quote(k) +
                               " is not valid UTF-8");
      }
      if (!first) json.push_back(',');
      first = false;
      AppendJsonString(json, k);
      json.push_back(':');
      AppendJsonString(json, v);
    }
    json.push_back('}');
    first = false;
  }

  std::unordered_set<std::string_view> names;
  names.reserve(entries.size());
  uint64_t pos = 0;
  for (const SafetensorsEntry& e : entries) {
    if (!IsValidUtf8(e.name)) {
      return InvalidArgument("safetensors entry name " + Quote(e.name) + " is not valid UTF-8");
    }
    if (e.name == kMetadataKey) {
      return InvalidArgument("safetensors entry may not be named \"__metadata__\"");
    }
    if (!names.insert(e.name).second) {
      return InvalidArgument("duplicate safetensors entry name " + Quote(e.name));
    }
    uint64_t bytes;
    if (!IsValidDType(static_cast<uint8_t>(e.dtype)) || !EntryBytes(e.shape, e.dtype, &bytes)) {
      return InvalidArgument("safetensors entry " + Quote(e.name) + ": invalid dtype or shape " +
                             ShapeToString(e.shape));
    }
    if (e.begin != pos || e.end < e.begin || e.end - e.begin != bytes) {
      return InvalidArgument("safetensors entry " + Quote(e.name) + ": data_offsets [" +
                             std::to_string(e.begin) + ", " + std::to_string(e.end) +
                             "] do not follow the previous entry (at " + std::to_string(pos) +
                             ") or do not match " + std::to_string(bytes) + " bytes of " +
                             std::string(DTypeName(e.dtype)) + " " + ShapeToString(e.shape));
    }
    pos = e.end;

    if (!first) json.push_back(',');
    first = false;
    AppendJsonString(json, e.name);
    json += ":{\"dtype\":\"";
    json += DTypeName(e.dtype);
    json += "\",\"shape\":[";
    for (size_t d = 0; d < e.shape.size(); ++d) {
      if (d) json.push_back(',');
      AppendInt(json, e.shape[d]);
    }
    json += "],\"data_offsets\":[";
    AppendInt(json, e.begin);
    json.push_back(',');
    AppendInt(json, e.end);
    json += "]}";
  }
  json.push_back('}');

  const uint64_t total = (8 + json.size() + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
  const uint64_t n = total - 8;
  if (n > kMaxSafetensorsHeaderBytes) {
    return InvalidArgument("safetensors header of " + std::to_string(n) + " bytes (" +
                           std::to_string(entries.size()) + " entries) exceeds the limit of " +
                           std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  Bytes out(total, static_cast<uint8_t>(' '));
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(out.data() + 8, json.data(), json.size());
  return out;
}

Result<SafetensorsHeader> ReadSafetensorsHeader(const ReadableFile& file) {
  const std::string& path = file.path();
  auto fail = [&](const std::string& what) {
    return DataLoss(path + ": invalid safetensors header: " + what);
  };
  const uint64_t size = file.size();
  if (size < 8) {
    return fail("file has " + std::to_string(size) + " bytes, fewer than the 8-byte length");
  }
  uint8_t len_bytes[8];
  TESSERA_RETURN_IF_ERROR(file.ReadAt(0, len_bytes, 8));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (n > kMaxSafetensorsHeaderBytes) {
    return fail("header length " + std::to_string(n) + " exceeds the limit of " +
                std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (n > size - 8) {
    return fail("header length " + std::to_string(n) + " runs past the end of the file (" +
                std::to_string(size) + " bytes)");
  }
  std::string text(n, '\0');
  TESSERA_RETURN_IF_ERROR(file.ReadAt(8, text.data(), n));
  if (n == 0 || text[0] != '{') return fail("header does not start with '{'");
  // JSON never holds a raw NUL; nlohmann's parser would take one for the end of the input.
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    return fail("invalid JSON at byte " + std::to_string(nul + 1) + ": NUL byte");
  }

  SafetensorsHeader header;
  header.data_start = 8 + n;
  HeaderParser parser(&header);
  bool ok = nlohmann::json::sax_parse(text.begin(), text.end(), &parser);
  if (!ok && parser.unsupported()) {
    return Unimplemented(path + ": safetensors header: " + parser.error() +
                         " by tessera (it reads F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8"
                         " U8 BOOL U16 U32 U64)");
  }
  if (!ok) return fail(parser.error().empty() ? "invalid JSON" : parser.error());

  // Every entry: dtype and size agree; sorted by offsets, back to back from 0 to the end.
  const uint64_t data_size = size - header.data_start;
  std::vector<uint32_t> order(header.entries.size());
  for (size_t i = 0; i < header.entries.size(); ++i) {
    const SafetensorsEntry& e = header.entries[i];
    uint64_t bytes;
    if (!EntryBytes(e.shape, e.dtype, &bytes)) {
      return fail("entry " + Quote(e.name) + ": shape " + ShapeToString(e.shape) + " is too large");
    }
    if (e.end < e.begin || e.end - e.begin != bytes) {
      return fail("entry " + Quote(e.name) + ": data_offsets [" + std::to_string(e.begin) + ", " +
                  std::to_string(e.end) + "] do not match " + std::to_string(bytes) + " bytes of " +
                  std::string(DTypeName(e.dtype)) + " " + ShapeToString(e.shape));
    }
    order[i] = static_cast<uint32_t>(i);
  }
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const SafetensorsEntry& x = header.entries[a];
    const SafetensorsEntry& y = header.entries[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t pos = 0;
  for (uint32_t i : order) {
    const SafetensorsEntry& e = header.entries[i];
    if (e.begin != pos) {
      return fail("entry " + Quote(e.name) + ": data_offsets [" + std::to_string(e.begin) + ", " +
                  std::to_string(e.end) + "] " +
                  (e.begin > pos ? "leave a hole" : "overlap another entry") + " at byte " +
                  std::to_string(pos) + " of the data section");
    }
    pos = e.end;
  }
  if (pos != data_size) {
    return fail("entries end at byte " + std::to_string(pos) + " of the data section, but it has " +
                std::to_string(data_size) + " bytes (file " + std::to_string(size) +
                " bytes, data starts at " + std::to_string(header.data_start) + ")");
  }
  return header;
}

}  // namespace tessera
