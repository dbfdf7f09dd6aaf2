// The S3 client against a server that lies (issue 30, docs/RELIABILITY.md section 10): a
// listing entry outside the prefix listed, a continuation token that repeats, a 206 reply with
// the bytes of another range, a short body. The server is a few lines of HTTP on loopback that
// answer each request with what the test says, so that every reply can be exactly the hostile
// one (moto and the fault proxy only send well-formed replies).
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "storage/s3/s3_client.h"
#include "storage/s3/s3_config.h"
#include "tessera/s3_storage.h"

namespace tessera::s3 {
namespace {

using ::testing::HasSubstr;

// Answers every request on loopback with reply(request head, number of the request), then
// closes the connection. One connection at a time.
class CannedServer {
 public:
  using Reply = std::function<std::string(const std::string& head, int n)>;
  // `trickle`: the wait between two bytes of the reply's body (zero: all at once).
  explicit CannedServer(Reply reply, std::chrono::milliseconds trickle = {})
      : reply_(std::move(reply)), trickle_(trickle) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    EXPECT_EQ(::listen(fd_, 16), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~CannedServer() {
    stopping_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int requests() const { return count_.load(); }

 private:
  void Serve() {
    while (!stopping_) {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      std::string head;
      char buf[4096];
      while (head.find("\r\n\r\n") == std::string::npos) {
        const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
        if (n <= 0) break;
        head.append(buf, static_cast<size_t>(n));
      }
      const std::string out = reply_(head, count_++);
      const size_t body = trickle_.count() > 0 ? out.find("\r\n\r\n") + 4 : out.size();
      for (size_t sent = 0; sent < out.size() && !stopping_;) {
        const size_t chunk = sent < body ? body - sent : 1;
        if (sent >= body) std::this_thread::sleep_for(trickle_);
        const ssize_t n = ::send(c, out.data() + sent, chunk, MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += static_cast<size_t>(n);
      }
      ::shutdown(c, SHUT_WR);
      while (::recv(c, buf, sizeof(buf), 0) > 0) {
      }
      ::close(c);
    }
  }

  Reply reply_;
  std::chrono::milliseconds trickle_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> count_{0};
  std::thread thread_;
};

std::string Http(int status, const std::string& body, const std::string& headers = "") {
  return "HTTP/1.1 " + std::to_string(status) + (status == 206 ? " Partial Content" : " OK") +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n" +
         headers + "\r\n" + body;
}

std::string ListReply(const std::vector<std::string>& keys, const std::vector<std::string>& dirs,
                      const std::string& token) {
  std::string xml =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>b</Name>"
      "<IsTruncated>" +
      std::string(token.empty() ? "false" : "true") + "</IsTruncated>";
  if (!token.empty()) xml += "<NextContinuationToken>" + token + "</NextContinuationToken>";
  for (const std::string& k : keys)
    xml += "<Contents><Key>" + k + "</Key><Size>1</Size></Contents>";
  for (const std::string& d : dirs)
    xml += "<CommonPrefixes><Prefix>" + d + "</Prefix></CommonPrefixes>";
  return Http(200, xml + "</ListBucketResult>", "Content-Type: application/xml\r\n");
}

std::shared_ptr<S3Client> ClientOf(const CannedServer& server,
                                   std::chrono::milliseconds max_total = {}) {
  S3ClientOptions options;
  options.config.credentials = Credentials{"AKIDTEST", "secret", ""};
  options.config.region = "us-east-1";
  options.config.endpoint_url = server.endpoint();
  options.config.addressing_style = AddressingStyle::kPath;
  options.retry.max_attempts = 2;
  if (max_total.count() > 0) options.retry.max_total = max_total;
  Result<std::shared_ptr<S3Client>> client = S3Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  return client.ok() ? *client : nullptr;
}

// Defect 12: a key shorter than the prefix listed made S3Storage::ListDir's substr throw.
TEST(S3HostileServerTest, AListingEntryOutsideThePrefixIsAnErrorNamingIt) {
  for (int which = 0; which < 3; ++which) {
    CannedServer server([&](const std::string&, int) {
      if (which == 0) return ListReply({"ru"}, {}, "");  // shorter than "run/"
      if (which == 1) return ListReply({}, {"r/"}, "");  // a common prefix likewise
      return ListReply({"other/x"}, {}, "");             // longer, but elsewhere
    });
    std::shared_ptr<S3Client> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    Result<ListResult> listed = client->ListObjects("b", "run/", "/");
    EXPECT_EQ(listed.status().code(), StatusCode::kDataLoss) << listed.status().ToString();
    EXPECT_THAT(listed.status().message(), HasSubstr("not under the prefix listed"));
    EXPECT_THAT(listed.status().message(), HasSubstr("s3://b/run/"));
  }
}

// A key listed under the delimiter that lies deeper than the directory is not an entry of it.
TEST(S3HostileServerTest, AListedKeyDeeperThanTheDirectoryIsAnError) {
  CannedServer server([](const std::string&, int) { return ListReply({"run/a/b"}, {}, ""); });
  std::shared_ptr<S3Client> client = ClientOf(server);
  ASSERT_NE(client, nullptr);
  auto storage = std::make_shared<S3Storage>(client, "b");
  Result<std::vector<std::string>> names = storage->ListDir("run");
  EXPECT_EQ(names.status().code(), StatusCode::kDataLoss) << names.status().ToString();
  EXPECT_THAT(names.status().message(), HasSubstr("lies deeper"));
}

// Defect 10: a reply that stays truncated with the same continuation token paged forever.
TEST(S3HostileServerTest, ARepeatedContinuationTokenEndsTheListingWithAnError) {
  CannedServer server([](const std::string&, int n) {
    return ListReply({"run/f" + std::to_string(n)}, {}, "same-token");
  });
  std::shared_ptr<S3Client> client = ClientOf(server);
  ASSERT_NE(client, nullptr);
  Result<ListResult> listed = client->ListObjects("b", "run/", "");
  EXPECT_EQ(listed.status().code(), StatusCode::kDataLoss) << listed.status().ToString();
  EXPECT_THAT(listed.status().message(), HasSubstr("same continuation token twice"));
  EXPECT_LE(server.requests(), 3);
}

// ... and so does a server that sends ever new tokens with nothing in the pages.
TEST(S3HostileServerTest, EndlessEmptyTruncatedPagesEndWithAnError) {
  CannedServer server(
      [](const std::string&, int n) { return ListReply({}, {}, "t" + std::to_string(n)); });
  std::shared_ptr<S3Client> client = ClientOf(server);
  ASSERT_NE(client, nullptr);
  Result<ListResult> listed = client->ListObjects("b", "run/", "");
  EXPECT_EQ(listed.status().code(), StatusCode::kDataLoss) << listed.status().ToString();
  EXPECT_THAT(listed.status().message(), HasSubstr("without an entry"));
}

// Defect 9: a 206 reply of the right length with the bytes of another offset was accepted.
TEST(S3HostileServerTest, A206ForAnotherRangeIsRetriedThenRefused) {
  CannedServer server([](const std::string&, int) {
    return Http(206, "WXYZ", "Content-Range: bytes 0-3/100\r\n");  // asked: 10-13
  });
  std::shared_ptr<S3Client> client = ClientOf(server);
  ASSERT_NE(client, nullptr);
  std::string dst(4, '\0');
  const Status read =
      client->GetRange("b", "run/f", 10, std::as_writable_bytes(std::span(dst.data(), 4)), "");
  EXPECT_EQ(read.code(), StatusCode::kDataLoss) << read.ToString();
  EXPECT_THAT(read.message(), HasSubstr("s3://b/run/f bytes 10-13"));
  EXPECT_THAT(read.message(), HasSubstr("carries the bytes 0-3"));
  // Retried under the client's RetryPolicy (max_attempts 2 here), like a 5xx.
  EXPECT_EQ(server.requests(), 2);
  EXPECT_THAT(read.message(), HasSubstr("gave up after 2 attempts"));
}

// A wrong or short reply followed by the right one: the read succeeds with the right bytes
// (issue 30, defect 20: a truncated read was never retried).
TEST(S3HostileServerTest, AWrongThenARightReplyReadsTheRightBytes) {
  for (const std::string& first :
       {Http(206, "WXYZ", "Content-Range: bytes 0-3/100\r\n"),
        Http(206, "AB", "Content-Range: bytes 10-11/100\r\n"), Http(206, "ABCD", "")}) {
    CannedServer server([&](const std::string& head, int n) {
      EXPECT_THAT(head, HasSubstr("bytes=10-13"));
      return n == 0 ? first : Http(206, "ABCD", "Content-Range: bytes 10-13/100\r\n");
    });
    std::shared_ptr<S3Client> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    std::string dst(4, '\0');
    const Status read =
        client->GetRange("b", "run/f", 10, std::as_writable_bytes(std::span(dst.data(), 4)), "");
    ASSERT_TRUE(read.ok()) << read.ToString();
    EXPECT_EQ(dst, "ABCD");
    EXPECT_EQ(server.requests(), 2);
  }
}

// A server that ignores Range answers 200 with the whole object: fine from offset 0 when it
// fits exactly, never taken for the bytes of another offset.
TEST(S3HostileServerTest, A200ToARangedReadIsTakenOnlyFromOffsetZero) {
  CannedServer server([](const std::string&, int) { return Http(200, "ABCD"); });
  std::shared_ptr<S3Client> client = ClientOf(server);
  ASSERT_NE(client, nullptr);
  std::string dst(4, '\0');
  ASSERT_TRUE(
      client->GetRange("b", "run/f", 0, std::as_writable_bytes(std::span(dst.data(), 4)), "").ok());
  EXPECT_EQ(dst, "ABCD");
  const Status later =
      client->GetRange("b", "run/f", 4, std::as_writable_bytes(std::span(dst.data(), 4)), "");
  EXPECT_EQ(later.code(), StatusCode::kDataLoss) << later.ToString();
  EXPECT_THAT(later.message(), HasSubstr("ignored Range"));
}

// GetPrefix takes a reply for the object's head only when it is one: a 206 for bytes 0-(n-1)
// whose Content-Range gives the size and whose body holds exactly min(asked, size) bytes.
// Anything else is retried, then refused naming the object; a server that ignores Range
// (a 200 with the whole object) is taken when the object fit, else a HEAD answers.
TEST(S3HostileServerTest, APrefixReplyIsTakenOnlyWhenItIsTheObjectsHead) {
  for (const std::string& wrong :
       {Http(206, "ABCD", "Content-Range: bytes 4-7/100\r\n"),
        Http(206, "ABCD", "Content-Range: bytes 0-3/*\r\n"),
        Http(206, "AB", "Content-Range: bytes 0-1/100\r\n"),
        Http(206, "ABCD", "Content-Range: bytes 0-3/3\r\n"), Http(206, "ABCD", "")}) {
    CannedServer server([&](const std::string& head, int) {
      EXPECT_THAT(head, HasSubstr("bytes=0-3"));
      return wrong;
    });
    std::shared_ptr<S3Client> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    Result<ObjectPrefix> got = client->GetPrefix("b", "run/f", 4);
    EXPECT_EQ(got.status().code(), StatusCode::kDataLoss) << wrong;
    EXPECT_THAT(got.status().message(), HasSubstr("s3://b/run/f bytes 0-3")) << wrong;
    EXPECT_EQ(server.requests(), 2) << "retried like a 5xx";
  }
  {
    CannedServer server([](const std::string&, int) {
      return Http(206, "ABCD", "Content-Range: bytes 0-3/100\r\nETag: \"e1\"\r\n");
    });
    std::shared_ptr<S3Client> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    Result<ObjectPrefix> got = client->GetPrefix("b", "run/f", 4);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->info.size, 100u);
    EXPECT_EQ(got->info.etag, "\"e1\"");
    EXPECT_EQ(got->bytes, "ABCD");
  }
  {
    CannedServer server([](const std::string&, int) { return Http(200, "AB"); });
    std::shared_ptr<S3Client> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    Result<ObjectPrefix> got = client->GetPrefix("b", "run/f", 4);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->info.size, 2u);
    EXPECT_EQ(got->bytes, "AB");
  }
  {
    CannedServer server([](const std::string& head, int) {
      if (head.starts_with("HEAD")) {
        return std::string(
            "HTTP/1.1 200 OK\r\nContent-Length: 8\r\nETag: \"e2\"\r\n"
            "Connection: close\r\n\r\n");
      }
      return Http(200, "ABCDEFGH");  // Range ignored: more than the 4 bytes asked
    });
    std::shared_ptr<S3Client> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    Result<ObjectPrefix> got = client->GetPrefix("b", "run/f", 4);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(got->bytes.empty());
    EXPECT_EQ(got->info.size, 8u);
    EXPECT_EQ(got->info.etag, "\"e2\"");
  }
}

// Defect 20: a credential written into the endpoint URL was echoed in the error message.
TEST(S3HostileServerTest, CredentialsInAnEndpointUrlAreNeverPrinted) {
  EXPECT_EQ(RedactUrl("http://user:secret@127.0.0.1:9000/base"), "http://***@127.0.0.1:9000/base");
  EXPECT_EQ(RedactUrl("https://host/path@x"), "https://host/path@x");  // no user-info
  EXPECT_EQ(RedactUrl("user:secret@host"), "***@host");
  S3ClientOptions options;
  options.config.credentials = Credentials{"AKIDTEST", "secret", ""};
  options.config.region = "us-east-1";
  for (const std::string url : {"http://AKID:hunter2@127.0.0.1:9", "ftp://AKID:hunter2@host"}) {
    options.config.endpoint_url = url;
    Result<std::shared_ptr<S3Client>> client = S3Client::Create(options);
    EXPECT_EQ(client.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(client.status().message(), ::testing::Not(HasSubstr("hunter2")));
    EXPECT_THAT(client.status().message(), HasSubstr("***@"));
  }
}

// Defect 11: a body trickled a byte at a time never trips the stall timeout, and outlived the
// per-request limit (RetryPolicy::max_total) by as long as the server liked.
TEST(S3HostileServerTest, ATrickledReplyEndsWithinTheRequestsTimeLimit) {
  CannedServer server(
      [](const std::string&, int) {
        return Http(206, std::string(64, 'x'), "Content-Range: bytes 0-63/64\r\n");
      },
      std::chrono::milliseconds(100));  // 6.4 s for the body
  std::shared_ptr<S3Client> client = ClientOf(server, std::chrono::milliseconds(1500));
  ASSERT_NE(client, nullptr);
  std::string dst(64, '\0');
  const auto start = std::chrono::steady_clock::now();
  const Status read =
      client->GetRange("b", "run/f", 0, std::as_writable_bytes(std::span(dst.data(), 64)), "");
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_FALSE(read.ok());
  EXPECT_THAT(read.message(), HasSubstr("s3://b/run/f"));
  EXPECT_LT(took, std::chrono::milliseconds(4000)) << read.ToString();
}

}  // namespace
}  // namespace tessera::s3
