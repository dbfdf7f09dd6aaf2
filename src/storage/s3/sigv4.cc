#include "storage/s3/sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <ctime>

namespace tessera::s3 {
namespace {

constexpr char kHexUpper[] = "0123456789ABCDEF";

std::string ToLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// A header value as SigV4 canonicalises it: leading and trailing spaces trimmed, runs of
// spaces inside collapsed to one.
std::string TrimAll(std::string_view v) {
  std::string out;
  bool space = false;
  for (char c : v) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out.push_back(' ');
    space = false;
    out.push_back(c);
  }
  return out;
}

std::string Sha256HexOf(const void* data, size_t n) {
  uint8_t digest[32];
  unsigned int len = 0;
  EVP_Digest(data, n, digest, &len, EVP_sha256(), nullptr);
  return HexEncode(std::span<const uint8_t>(digest, len));
}

}  // namespace

std::string Sha256Hex(std::span<const std::byte> data) {
  return Sha256HexOf(data.data(), data.size());
}

std::string Sha256Hex(std::string_view data) { return Sha256HexOf(data.data(), data.size()); }

std::array<uint8_t, 32> HmacSha256(std::span<const uint8_t> key, std::string_view data) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out.data(), &len);
  return out;
}

std::string UriEncode(std::string_view s, bool keep_slash) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    const bool unreserved = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                            (c >= '0' && c <= '9') || c == '-' || c == '.' || c == '_' ||
                            c == '~' || (keep_slash && c == '/');
    if (unreserved) {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHexUpper[c >> 4]);
      out.push_back(kHexUpper[c & 15]);
    }
  }
  return out;
}

std::string AmzDate(std::chrono::system_clock::time_point t) {
  const std::time_t seconds = std::chrono::system_clock::to_time_t(t);
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char buf[20];
  std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &utc);
  return buf;
}

std::string CanonicalQuery(const std::vector<std::pair<std::string, std::string>>& query) {
  std::vector<std::pair<std::string, std::string>> encoded;
  encoded.reserve(query.size());
  for (const auto& [name, value] : query) {
    encoded.emplace_back(UriEncode(name, false), UriEncode(value, false));
  }
  std::sort(encoded.begin(), encoded.end());
  std::string out;
  for (const auto& [name, value] : encoded) {
    if (!out.empty()) out.push_back('&');
    out += name;
    out.push_back('=');
    out += value;
  }
  return out;
}

Signature SignV4(const SignableRequest& request, const Credentials& credentials,
                 const SigningScope& scope, std::string_view amz_date) {
  // Headers: lower-case names, sorted; values of a repeated name joined by ','.
  std::vector<std::pair<std::string, std::string>> headers;
  for (const auto& [name, value] : request.headers) {
    headers.emplace_back(ToLower(name), TrimAll(value));
  }
  std::stable_sort(headers.begin(), headers.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string canonical_headers, signed_headers;
  for (size_t i = 0; i < headers.size(); ++i) {
    if (i > 0 && headers[i].first == headers[i - 1].first) {
      canonical_headers.back() = ',';  // replaces the previous line's '\n'
      canonical_headers += headers[i].second + "\n";
      continue;
    }
    canonical_headers += headers[i].first + ":" + headers[i].second + "\n";
    if (!signed_headers.empty()) signed_headers.push_back(';');
    signed_headers += headers[i].first;
  }

  Signature sig;
  sig.signed_headers = signed_headers;
  sig.canonical_request = request.method + "\n" + request.canonical_uri + "\n" +
                          CanonicalQuery(request.query) + "\n" + canonical_headers + "\n" +
                          signed_headers + "\n" + request.payload_hash;
  const std::string date(amz_date.substr(0, 8));
  const std::string credential_scope =
      date + "/" + scope.region + "/" + scope.service + "/aws4_request";
  sig.string_to_sign = "AWS4-HMAC-SHA256\n" + std::string(amz_date) + "\n" + credential_scope +
                       "\n" + Sha256Hex(sig.canonical_request);

  const std::string secret = "AWS4" + credentials.secret_access_key;
  auto key = HmacSha256(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(secret.data()), secret.size()),
      date);
  key = HmacSha256(key, scope.region);
  key = HmacSha256(key, scope.service);
  key = HmacSha256(key, "aws4_request");
  sig.signature = HexEncode(HmacSha256(key, sig.string_to_sign));
  sig.authorization = "AWS4-HMAC-SHA256 Credential=" + credentials.access_key_id + "/" +
                      credential_scope + ", SignedHeaders=" + signed_headers +
                      ", Signature=" + sig.signature;
  return sig;
}

}  // namespace tessera::s3
