// The XML of S3's replies and request bodies, through pugixml (Debian's libpugixml).
//
// The parsers read other people's bytes: they are bounded by the body they are given (the HTTP
// layer caps bodies at HttpOptions::max_body_bytes), never recurse on the input's depth beyond
// the fixed paths they look up, and report malformed input as kDataLoss naming the request.
// Fuzzed by s3_xml_fuzz.cc.
#ifndef TESSERA_STORAGE_S3_S3_XML_H_
#define TESSERA_STORAGE_S3_S3_XML_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/status.h"

namespace tessera::s3 {

// <Error><Code>..</Code><Message>..</Message><RequestId>..</RequestId></Error>; all empty when
// the body is not such a document (a HEAD reply has no body).
struct S3ErrorBody {
  std::string code;
  std::string message;
  std::string request_id;
};
S3ErrorBody ParseErrorBody(std::string_view body);

struct ListedObject {
  std::string key;
  uint64_t size = 0;
  std::string etag;
};

struct ListPage {
  std::vector<ListedObject> objects;
  std::vector<std::string> common_prefixes;
  bool truncated = false;
  std::string next_continuation_token;
};
// A ListObjectsV2 reply requested with encoding-type=url (keys are percent-decoded here).
Result<ListPage> ParseListObjectsV2(std::string_view body);

// The UploadId of an InitiateMultipartUploadResult.
Result<std::string> ParseInitiateMultipartUpload(std::string_view body);

// A CompleteMultipartUpload reply: S3 may answer 200 with an <Error> document when the
// completion failed after the headers were sent; that comes back as `error`.
struct CompleteResult {
  std::string etag;
  S3ErrorBody error;  // code non-empty when the completion failed
};
Result<CompleteResult> ParseCompleteMultipartUpload(std::string_view body);

// The keys a DeleteObjects request could not delete (its <Error> entries).
struct DeleteError {
  std::string key;
  std::string code;
  std::string message;
};
Result<std::vector<DeleteError>> ParseDeleteResult(std::string_view body);

struct UploadListing {
  struct Upload {
    std::string key;
    std::string upload_id;
    std::string initiated;  // ISO 8601, as S3 wrote it
  };
  std::vector<Upload> uploads;
  bool truncated = false;
  std::string next_key_marker;
  std::string next_upload_id_marker;
};
// A ListMultipartUploads reply requested with encoding-type=url.
Result<UploadListing> ParseListMultipartUploads(std::string_view body);

struct CompletedPart {
  int number = 0;
  std::string etag;
  std::string checksum_crc32c;  // base64; empty when not sent
};
std::string CompleteMultipartUploadBody(const std::vector<CompletedPart>& parts);
// At most 1000 keys (S3's limit per request).
std::string DeleteObjectsBody(const std::vector<std::string>& keys);

// Percent-decoding of keys S3 returned with encoding-type=url ('+' is a space).
std::string UrlDecode(std::string_view s);

// A 206 reply's Content-Range header, "bytes first-last/size" (RFC 9110 14.4); `size` is
// nullopt where the server sent "*" (unknown). nullopt when absent (null), of another form, or
// inconsistent (last before first, a size not past last). Not XML, but a parser of the same
// replies, fuzzed with them.
struct ContentRange {
  uint64_t first = 0, last = 0;
  std::optional<uint64_t> size;
};
std::optional<ContentRange> ParseContentRange(const std::string* header);

}  // namespace tessera::s3

#endif  // TESSERA_STORAGE_S3_S3_XML_H_
