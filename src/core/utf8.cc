#include "core/utf8.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>

namespace tessera {

namespace {

// The length of the well-formed UTF-8 sequence at `p` (before `end`) and its code point, or 0
// when the byte at `p` starts none (overlong forms, surrogates, > U+10FFFF, truncated).
int SequenceAt(const unsigned char* p, const unsigned char* end, uint32_t* code_point) {
  const unsigned char c = *p;
  if (c < 0x80) {
    *code_point = c;
    return 1;
  }
  int n;
  uint32_t min;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 1, min = 0x80, cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 2, min = 0x800, cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 3, min = 0x10000, cp = c & 0x07;
  } else {
    return 0;
  }
  if (end - p <= n) return 0;
  for (int i = 1; i <= n; ++i) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (p[i] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  *code_point = cp;
  return n + 1;
}

void AppendEscapedByte(std::string& out, unsigned char c) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "\\x%02x", c);
  out += buf;
}

}  // namespace

bool IsValidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  uint32_t cp;
  while (p < end) {
    const int n = SequenceAt(p, end, &cp);
    if (n == 0) return false;
    p += n;
  }
  return true;
}

std::string ReplaceInvalidUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  uint32_t cp;
  while (p < end) {
    const int n = SequenceAt(p, end, &cp);
    if (n == 0) {
      out += "\xef\xbf\xbd";  // U+FFFD
      ++p;
    } else {
      out.append(reinterpret_cast<const char*>(p), n);
      p += n;
    }
  }
  return out;
}

std::string EscapeControlCharacters(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  uint32_t cp;
  while (p < end) {
    const int n = SequenceAt(p, end, &cp);
    const bool control = n > 0 && (cp < 0x20 || (cp >= 0x7F && cp <= 0x9F));
    if (n > 0 && !control) {
      out.append(reinterpret_cast<const char*>(p), n);
      p += n;
      continue;
    }
    for (int i = 0; i < std::max(n, 1); ++i) AppendEscapedByte(out, p[i]);
    p += std::max(n, 1);
  }
  return out;
}

std::string QuoteBytes(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  return out + "\"";
}

Status CheckMetadataIsUtf8(const Metadata& m, std::string_view source) {
  auto check = [&](const std::string& s, const std::string& what) -> Status {
    if (IsValidUtf8(s)) return Status::Ok();
    return DataLoss(std::string(source) + ": " + what + " " + QuoteBytes(s) +
                    " is not valid UTF-8 (tessera writes keys, file names and user metadata as "
                    "UTF-8 text; this manifest is corrupt or was not written by tessera)");
  };
  for (const auto& [k, v] : m.user_metadata) {
    TESSERA_RETURN_IF_ERROR(check(k, "user metadata key"));
    TESSERA_RETURN_IF_ERROR(check(v, "user metadata value of " + QuoteBytes(k)));
  }
  for (const TensorInfo& t : m.tensors) TESSERA_RETURN_IF_ERROR(check(t.key, "tensor key"));
  for (const ObjectInfo& o : m.objects) TESSERA_RETURN_IF_ERROR(check(o.key, "object key"));
  for (const FileInfo& f : m.files) TESSERA_RETURN_IF_ERROR(check(f.name, "file name"));
  return check(m.save_id, "save id");
}

}  // namespace tessera
