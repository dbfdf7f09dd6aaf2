// libFuzzer target: every parser of S3's replies (XML, Content-Range) on arbitrary bytes
// (scripts/fuzz; seeds in fuzz/corpus/s3_xml/). The parsers must return a Status, never crash or
// read out of bounds.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "storage/s3/s3_xml.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  (void)tessera::s3::ParseErrorBody(body);
  (void)tessera::s3::ParseListObjectsV2(body).ok();
  (void)tessera::s3::ParseInitiateMultipartUpload(body).ok();
  (void)tessera::s3::ParseCompleteMultipartUpload(body).ok();
  (void)tessera::s3::ParseDeleteResult(body).ok();
  (void)tessera::s3::ParseListMultipartUploads(body).ok();
  (void)tessera::s3::UrlDecode(body);
  const std::string header(body);
  (void)tessera::s3::ParseContentRange(&header);
  return 0;
}
