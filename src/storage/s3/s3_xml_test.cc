// S3's XML replies: what the parsers take from them, and what they refuse.
#include "storage/s3/s3_xml.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tessera::s3 {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(S3XmlTest, ErrorBodies) {
  const S3ErrorBody e = ParseErrorBody(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>NoSuchKey</Code><Message>The "
      "specified key does not exist.</Message><Key>a</Key><RequestId>4442587FB7D0A2F9</RequestId>"
      "</Error>");
  EXPECT_EQ(e.code, "NoSuchKey");
  EXPECT_EQ(e.message, "The specified key does not exist.");
  EXPECT_EQ(e.request_id, "4442587FB7D0A2F9");
  EXPECT_EQ(ParseErrorBody("").code, "");
  EXPECT_EQ(ParseErrorBody("<html>502 Bad Gateway</html>").code, "");
  EXPECT_EQ(ParseErrorBody("<ErrorResponse><Error><Code>X</Code></Error></ErrorResponse>").code,
            "X");
}

TEST(S3XmlTest, ListObjectsV2WithUrlEncodedKeys) {
  Result<ListPage> page = ParseListObjectsV2(
      "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>b</Name>"
      "<Prefix>ckpt%2F</Prefix><KeyCount>3</KeyCount><MaxKeys>3</MaxKeys>"
      "<EncodingType>url</EncodingType><IsTruncated>true</IsTruncated>"
      "<Contents><Key>ckpt/a%20b+c</Key><Size>10</Size><ETag>&quot;e1&quot;</ETag></Contents>"
      "<Contents><Key>ckpt/%C3%A9</Key><Size>18446744073709551615</Size></Contents>"
      "<CommonPrefixes><Prefix>ckpt/sub%25/</Prefix></CommonPrefixes>"
      "<NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>"
      "</ListBucketResult>");
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  ASSERT_EQ(page->objects.size(), 2u);
  EXPECT_EQ(page->objects[0].key, "ckpt/a b c");
  EXPECT_EQ(page->objects[0].size, 10u);
  EXPECT_EQ(page->objects[0].etag, "\"e1\"");
  EXPECT_EQ(page->objects[1].key, "ckpt/\xc3\xa9");
  EXPECT_EQ(page->objects[1].size, ~uint64_t{0});
  EXPECT_THAT(page->common_prefixes, ElementsAre("ckpt/sub%/"));
  EXPECT_TRUE(page->truncated);
  EXPECT_EQ(page->next_continuation_token, "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=");
}

TEST(S3XmlTest, MalformedListingsAreDataLoss) {
  for (const char* body : {
           "<ListBucketResult><Contents><Key>a</Key><Size>-1</Size></Contents></ListBucketResult>",
           "<ListBucketResult><Contents><Key>a</Key><Size>12x</Size></Contents></ListBucketResult>",
           "<ListBucketResult><Contents><Key>a</Key></Contents></ListBucketResult>",
           "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
           "<ListBucketResult><Contents>",
           "<Other/>",
           "",
       }) {
    Result<ListPage> page = ParseListObjectsV2(body);
    EXPECT_EQ(page.status().code(), StatusCode::kDataLoss) << body;
  }
  EXPECT_THAT(ParseListObjectsV2("<Other/>").status().message(), HasSubstr("'Other'"));
}

TEST(S3XmlTest, MultipartReplies) {
  Result<std::string> id = ParseInitiateMultipartUpload(
      "<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><UploadId>VXBsb2FkIElE</"
      "UploadId>"
      "</InitiateMultipartUploadResult>");
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(*id, "VXBsb2FkIElE");
  EXPECT_EQ(ParseInitiateMultipartUpload("<InitiateMultipartUploadResult/>").status().code(),
            StatusCode::kDataLoss);

  Result<CompleteResult> done = ParseCompleteMultipartUpload(
      "<CompleteMultipartUploadResult><ETag>\"3858f62230ac3c915f300c664312c11f-9\"</ETag>"
      "</CompleteMultipartUploadResult>");
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->etag, "\"3858f62230ac3c915f300c664312c11f-9\"");
  EXPECT_TRUE(done->error.code.empty());
  // S3 can answer 200 with an error document when the completion fails late.
  Result<CompleteResult> late = ParseCompleteMultipartUpload(
      "<Error><Code>InternalError</Code><Message>We encountered an internal "
      "error.</Message></Error>");
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->error.code, "InternalError");

  Result<UploadListing> uploads = ParseListMultipartUploads(
      "<ListMultipartUploadsResult><IsTruncated>true</IsTruncated>"
      "<NextKeyMarker>a%2Fb</NextKeyMarker><NextUploadIdMarker>u2</NextUploadIdMarker>"
      "<Upload><Key>a%2Fb</Key><UploadId>u2</UploadId><Initiated>2010-11-10T20:48:33.000Z</"
      "Initiated>"
      "</Upload></ListMultipartUploadsResult>");
  ASSERT_TRUE(uploads.ok());
  ASSERT_EQ(uploads->uploads.size(), 1u);
  EXPECT_EQ(uploads->uploads[0].key, "a/b");
  EXPECT_EQ(uploads->next_key_marker, "a/b");
  EXPECT_EQ(ParseListMultipartUploads("<ListMultipartUploadsResult><IsTruncated>true</"
                                      "IsTruncated></ListMultipartUploadsResult>")
                .status()
                .code(),
            StatusCode::kDataLoss);
}

TEST(S3XmlTest, DeleteResults) {
  Result<std::vector<DeleteError>> errors = ParseDeleteResult(
      "<DeleteResult><Deleted><Key>a</Key></Deleted><Error><Key>b</Key><Code>AccessDenied</Code>"
      "<Message>Access Denied</Message></Error></DeleteResult>");
  ASSERT_TRUE(errors.ok());
  ASSERT_EQ(errors->size(), 1u);
  EXPECT_EQ((*errors)[0].key, "b");
  EXPECT_EQ((*errors)[0].code, "AccessDenied");
}

TEST(S3XmlTest, RequestBodiesEscapeKeysAndEtags) {
  EXPECT_EQ(DeleteObjectsBody({"a&b", "<c>"}),
            "<Delete xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Quiet>true</Quiet>"
            "<Object><Key>a&amp;b</Key></Object><Object><Key>&lt;c&gt;</Key></Object></Delete>");
  EXPECT_EQ(CompleteMultipartUploadBody({{1, "\"e1\"", "AAAAAA=="}, {2, "\"e2\"", ""}}),
            "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
            "<Part><PartNumber>1</PartNumber><ETag>&quot;e1&quot;</ETag>"
            "<ChecksumCRC32C>AAAAAA==</ChecksumCRC32C></Part>"
            "<Part><PartNumber>2</PartNumber><ETag>&quot;e2&quot;</ETag></Part>"
            "</CompleteMultipartUpload>");
}

TEST(S3XmlTest, ContentRangeParsesOnlyConsistentRanges) {
  auto parse = [](const std::string& text) { return ParseContentRange(&text); };
  const std::optional<ContentRange> known = parse("bytes 0-65535/1048576");
  ASSERT_TRUE(known.has_value());
  EXPECT_EQ(known->first, 0u);
  EXPECT_EQ(known->last, 65535u);
  EXPECT_EQ(known->size, std::optional<uint64_t>(1048576));
  const std::optional<ContentRange> unknown = parse("bytes 10-13/*");
  ASSERT_TRUE(unknown.has_value());
  EXPECT_FALSE(unknown->size.has_value());
  EXPECT_FALSE(ParseContentRange(nullptr).has_value());
  for (const char* bad :
       {"", "bytes ", "bytes 0-3", "bytes 4-3/10", "bytes 0-3/3", "bytes -3/10", "bytes 0-/10",
        "bytes 0-3/x", "items 0-3/10", "bytes 0-3/10 ", "bytes 0-99999999999999999999/1"}) {
    EXPECT_FALSE(parse(bad).has_value()) << bad;
  }
}

TEST(S3XmlTest, UrlDecode) {
  EXPECT_EQ(UrlDecode("a%20b+c%2Fd"), "a b c/d");
  EXPECT_EQ(UrlDecode("100%"), "100%");    // a lone '%' stays
  EXPECT_EQ(UrlDecode("%zz%4"), "%zz%4");  // so do bad escapes
}

}  // namespace
}  // namespace tessera::s3
