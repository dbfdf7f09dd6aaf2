// The SigV4 signer against published vectors. Their sources:
//  - AWS General Reference, "Signature Version 4 test suite" (aws-sig-v4-test-suite, dated
//    2015-08-30; the same files are in botocore's tests/unit/auth/aws4_testsuite): get-vanilla,
//    get-vanilla-query-order-key-case, post-vanilla. Credentials AKIDEXAMPLE /
//    wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY, us-east-1, service "service".
//  - Amazon S3 API Reference, "Signature Calculations for the Authorization Header:
//    Transferring Payload in a Single Chunk (AWS Signature Version 4)": the examples GET
//    Object, PUT Object, GET Bucket Lifecycle and Get Bucket (List Objects). Credentials
//    AKIAIOSFODNN7EXAMPLE / wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY, us-east-1, 20130524.
// botocore 1.44 computes the same signatures for all seven (checked when they were written
// here); s3_client_test.cc checks requests the client builds against botocore at test time.
#include "storage/s3/sigv4.h"

#include <gtest/gtest.h>

namespace tessera::s3 {
namespace {

constexpr char kEmptySha256[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

const Credentials kSuite{"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", ""};
const Credentials kS3Doc{"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", ""};

TEST(SigV4Test, AwsTestSuiteVectors) {
  struct Case {
    const char* name;
    const char* method;
    std::vector<std::pair<std::string, std::string>> query;
    const char* signature;
  };
  const Case cases[] = {
      {"get-vanilla",
       "GET",
       {},
       "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"},
      {"get-vanilla-query-order-key-case",
       "GET",
       {{"Param2", "value2"}, {"Param1", "value1"}},
       "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500"},
      {"post-vanilla",
       "POST",
       {},
       "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"},
  };
  for (const Case& c : cases) {
    SignableRequest r{
        .method = c.method,
        .canonical_uri = "/",
        .query = c.query,
        .headers = {{"Host", "example.amazonaws.com"}, {"X-Amz-Date", "20150830T123600Z"}},
        .payload_hash = kEmptySha256};
    const Signature s = SignV4(r, kSuite, {"us-east-1", "service"}, "20150830T123600Z");
    EXPECT_EQ(s.signature, c.signature) << c.name;
    EXPECT_EQ(s.authorization,
              "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
              "SignedHeaders=host;x-amz-date, Signature=" +
                  std::string(c.signature))
        << c.name;
  }
}

TEST(SigV4Test, S3DocumentationGetObject) {
  SignableRequest r{.method = "GET",
                    .canonical_uri = "/test.txt",
                    .headers = {{"Host", "examplebucket.s3.amazonaws.com"},
                                {"Range", "bytes=0-9"},
                                {"x-amz-content-sha256", kEmptySha256},
                                {"x-amz-date", "20130524T000000Z"}},
                    .payload_hash = kEmptySha256};
  const Signature s = SignV4(r, kS3Doc, {"us-east-1", "s3"}, "20130524T000000Z");
  EXPECT_EQ(
      s.canonical_request,
      "GET\n/test.txt\n\nhost:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n"
      "x-amz-content-sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
      "x-amz-date:20130524T000000Z\n\nhost;range;x-amz-content-sha256;x-amz-date\n"
      "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(s.string_to_sign,
            "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
            "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972");
  EXPECT_EQ(s.signature, "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
  EXPECT_EQ(s.authorization,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(SigV4Test, S3DocumentationPutObject) {
  const std::string body = "Welcome to Amazon S3.";
  const std::string hash = Sha256Hex(body);
  EXPECT_EQ(hash, "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
  SignableRequest r{.method = "PUT",
                    .canonical_uri = "/" + UriEncode("test$file.text", true),
                    .headers = {{"Host", "examplebucket.s3.amazonaws.com"},
                                {"Date", "Fri, 24 May 2013 00:00:00 GMT"},
                                {"x-amz-storage-class", "REDUCED_REDUNDANCY"},
                                {"x-amz-content-sha256", hash},
                                {"x-amz-date", "20130524T000000Z"}},
                    .payload_hash = hash};
  EXPECT_EQ(r.canonical_uri, "/test%24file.text");
  const Signature s = SignV4(r, kS3Doc, {"us-east-1", "s3"}, "20130524T000000Z");
  EXPECT_EQ(s.signed_headers, "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class");
  EXPECT_EQ(s.signature, "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
}

TEST(SigV4Test, S3DocumentationBucketRequests) {
  struct Case {
    std::vector<std::pair<std::string, std::string>> query;
    const char* signature;
  };
  const Case cases[] = {
      {{{"lifecycle", ""}}, "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"},
      {{{"max-keys", "2"}, {"prefix", "J"}},
       "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"},
  };
  for (const Case& c : cases) {
    SignableRequest r{.method = "GET",
                      .canonical_uri = "/",
                      .query = c.query,
                      .headers = {{"Host", "examplebucket.s3.amazonaws.com"},
                                  {"x-amz-content-sha256", kEmptySha256},
                                  {"x-amz-date", "20130524T000000Z"}},
                      .payload_hash = kEmptySha256};
    EXPECT_EQ(SignV4(r, kS3Doc, {"us-east-1", "s3"}, "20130524T000000Z").signature, c.signature);
  }
}

TEST(SigV4Test, UriEncodeKeepsOnlyUnreservedCharacters) {
  EXPECT_EQ(UriEncode("aZ09-._~", false), "aZ09-._~");
  EXPECT_EQ(UriEncode("a b/c+d=e&f", false), "a%20b%2Fc%2Bd%3De%26f");
  EXPECT_EQ(UriEncode("a b/c+d", true), "a%20b/c%2Bd");
  EXPECT_EQ(UriEncode("\xc3\xa9*", false), "%C3%A9%2A");  // UTF-8 bytes, upper-case hex
}

TEST(SigV4Test, CanonicalQuerySortsEncodedNamesThenValues) {
  EXPECT_EQ(CanonicalQuery({{"prefix", "a b/"}, {"list-type", "2"}, {"delimiter", "/"}}),
            "delimiter=%2F&list-type=2&prefix=a%20b%2F");
  EXPECT_EQ(CanonicalQuery({{"uploads", ""}}), "uploads=");
  EXPECT_EQ(CanonicalQuery({{"b", "2"}, {"b", "1"}, {"a", ""}}), "a=&b=1&b=2");
}

TEST(SigV4Test, HeadersAreLowerCasedTrimmedAndRepeatedNamesJoined) {
  SignableRequest r{.method = "GET",
                    .canonical_uri = "/",
                    .headers = {{"Host", "h"},
                                {"X-Amz-Meta-A", "  one   two  "},
                                {"x-amz-meta-a", "three"},
                                {"X-Amz-Date", "20150830T123600Z"}},
                    .payload_hash = kEmptySha256};
  const Signature s = SignV4(r, kSuite, {"us-east-1", "service"}, "20150830T123600Z");
  EXPECT_NE(s.canonical_request.find("x-amz-meta-a:one two,three\n"), std::string::npos)
      << s.canonical_request;
  EXPECT_EQ(s.signed_headers, "host;x-amz-date;x-amz-meta-a");
}

TEST(SigV4Test, AmzDateIsUtc) {
  EXPECT_EQ(AmzDate(std::chrono::system_clock::from_time_t(1440938160)), "20150830T123600Z");
  EXPECT_EQ(AmzDate(std::chrono::system_clock::from_time_t(0)), "19700101T000000Z");
}

}  // namespace
}  // namespace tessera::s3
