// AWS Signature Version 4 for S3 requests (the "Authorization: AWS4-HMAC-SHA256 ..." header),
// on OpenSSL's SHA-256 and HMAC.
//
// Hand-written rather than libcurl's CURLOPT_AWS_SIGV4 because Debian 12's libcurl (7.88) does
// not sort query parameters (curl issue #9717) and sends no x-amz-content-sha256, and there is
// no AWS SDK in Debian. The rules followed are S3's: the object key is URI-encoded once with
// '/' kept, and the path is not normalised (S3 keys may hold "//" or "./").
//
// Thread safety: free functions over values.
#ifndef TESSERA_STORAGE_S3_SIGV4_H_
#define TESSERA_STORAGE_S3_SIGV4_H_

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/hex.h"  // HexEncode

namespace tessera::s3 {

struct Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty unless temporary credentials
};

// The payload hash of a request whose body is not hashed (integrity then comes from TLS and
// the x-amz-checksum-* header).
inline constexpr std::string_view kUnsignedPayload = "UNSIGNED-PAYLOAD";

// Lower-case hex of the SHA-256 of `data`.
std::string Sha256Hex(std::span<const std::byte> data);
std::string Sha256Hex(std::string_view data);
std::array<uint8_t, 32> HmacSha256(std::span<const uint8_t> key, std::string_view data);

// RFC 3986 percent-encoding of every byte but the unreserved ones (A-Z a-z 0-9 - . _ ~), with
// upper-case hex, as SigV4 requires; with `keep_slash`, '/' is kept (object keys in paths).
std::string UriEncode(std::string_view s, bool keep_slash);

// "20150830T123600Z": the x-amz-date of `t` (UTC).
std::string AmzDate(std::chrono::system_clock::time_point t);

// What is signed. Names and values are as sent; the signer canonicalises them.
struct SignableRequest {
  std::string method;         // "GET", "PUT", ...
  std::string canonical_uri;  // the path as sent, already URI-encoded ("/bucket/a%20b")
  // Query parameters, decoded (the signer encodes them). A parameter without a value
  // ("?uploads") has an empty value.
  std::vector<std::pair<std::string, std::string>> query;
  // Every header to sign, "host" and "x-amz-date" included; all are signed.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string payload_hash;  // hex SHA-256 of the body, or kUnsignedPayload
};

struct SigningScope {
  std::string region;   // "us-east-1"
  std::string service;  // "s3"
};

struct Signature {
  std::string canonical_request;
  std::string string_to_sign;
  std::string signed_headers;  // "host;x-amz-date"
  std::string signature;       // lower-case hex
  std::string authorization;   // the Authorization header's value
};

// Signs `request` at `amz_date` (which must equal the request's x-amz-date header).
Signature SignV4(const SignableRequest& request, const Credentials& credentials,
                 const SigningScope& scope, std::string_view amz_date);

// The canonical query string of `query`: names and values encoded, sorted, joined by '&'. Also
// what a request sends, so that what is signed is what goes on the wire.
std::string CanonicalQuery(const std::vector<std::pair<std::string, std::string>>& query);

}  // namespace tessera::s3

#endif  // TESSERA_STORAGE_S3_SIGV4_H_
