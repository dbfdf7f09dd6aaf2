// S3Client's operations (s3_client.h), each one S3Call through Execute.
#include <openssl/evp.h>

#include <algorithm>
#include <charconv>
#include <ctime>
#include <set>
#include <thread>

#include "core/utf8.h"
#include "storage/s3/s3_client.h"
#include "storage/s3/s3_xml.h"

namespace tessera::s3 {
namespace {

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

std::string Unquote(std::string s) {
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

std::string Md5Hex(std::span<const uint8_t> data) {
  uint8_t digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), digest, &len, EVP_md5(), nullptr);
  return HexEncode(std::span<const uint8_t>(digest, len));
}

// The ETag S3 gives a multipart object: the MD5 of the parts' binary MD5s, then "-N". Empty
// when a part's ETag is not an MD5 (SSE-KMS objects).
std::string MultipartEtag(const std::vector<CompletedPart>& parts) {
  std::vector<uint8_t> md5s;
  for (const CompletedPart& p : parts) {
    const std::string hex = Unquote(p.etag);
    if (hex.size() != 32) return "";
    for (size_t i = 0; i < 32; i += 2) {
      md5s.push_back(static_cast<uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
  }
  return Md5Hex(md5s) + "-" + std::to_string(parts.size());
}

// The composite CRC-32C S3 reports for a multipart object: the CRC-32C of the parts'
// big-endian CRC-32Cs, then "-N".
Result<std::string> CompositeCrc32c(const std::vector<CompletedPart>& parts) {
  std::vector<uint8_t> crcs;
  for (const CompletedPart& p : parts) {
    TESSERA_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, Base64Decode(p.checksum_crc32c));
    crcs.insert(crcs.end(), raw.begin(), raw.end());
  }
  return Crc32cBase64(Crc32c(std::as_bytes(std::span<const uint8_t>(crcs)))) + "-" +
         std::to_string(parts.size());
}

Status Rewrap(const Status& s, StatusCode code, const std::string& message) {
  return Status(code, message + " (" + s.message() + ")");
}

}  // namespace

std::optional<std::time_t> ParseIso8601(const std::string& s) {
  std::tm tm{};
  if (sscanf(s.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
             &tm.tm_hour, &tm.tm_min, &tm.tm_sec) != 6) {
    return std::nullopt;
  }
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return timegm(&tm);
}

Result<ObjectInfo> S3Client::HeadObject(const std::string& bucket, const std::string& key,
                                        bool with_checksum) {
  S3Call call{.op = S3Op::kHead, .method = "HEAD", .bucket = bucket, .key = key};
  if (with_checksum) call.headers.emplace_back("x-amz-checksum-mode", "ENABLED");
  S3CallResult r = Execute(call);
  if (!r.status.ok()) {
    if (r.status.code() == StatusCode::kNotFound) {
      return NotFound(Uri(bucket, key) + ": no such object (" + r.status.message() + ")");
    }
    return r.status;
  }
  ObjectInfo info;
  const std::string* length = r.response.Header("content-length");
  if (length == nullptr) {
    return DataLoss(Uri(bucket, key) + ": the HEAD reply has no Content-Length");
  }
  const char* end = length->data() + length->size();
  if (length->empty() || std::from_chars(length->data(), end, info.size).ptr != end) {
    return DataLoss(Uri(bucket, key) + ": Content-Length '" + *length + "' is not a byte count");
  }
  if (const std::string* etag = r.response.Header("etag")) info.etag = *etag;
  if (const std::string* crc = r.response.Header("x-amz-checksum-crc32c")) {
    info.checksum_crc32c = *crc;
  }
  return info;
}

namespace {

// OK when `response` holds exactly the bytes [first, last] of the object: a 206 whose
// Content-Range says that range ("bytes first-last/total", RFC 9110 14.4), or a 200 (a server
// that ignored Range) for a read from offset 0, whose body then was the whole object and had to
// fit the buffer; and as many body bytes as asked for.
Status CheckRangedReply(const HttpResponse& response, uint64_t first, uint64_t last,
                        uint64_t expected_bytes, const std::string& where) {
  const auto bad = [&](const std::string& why) {
    return DataLoss(where + ": HTTP " + std::to_string(response.status) + " " + why);
  };
  if (response.status == 200 && first != 0) {
    return bad("for a ranged read that does not start at 0 (the server ignored Range)");
  }
  if (response.status != 200 && response.status != 206) return bad("(expected 206)");
  if (response.body_bytes != expected_bytes) {
    return bad("with " + std::to_string(response.body_bytes) + " bytes of " +
               std::to_string(expected_bytes) + " (object shorter than when opened; truncated?)");
  }
  if (response.status == 206) {
    const std::string* range = response.Header("content-range");
    const std::optional<ContentRange> got = ParseContentRange(range);
    if (!got) {
      return bad("without a Content-Range of the form 'bytes first-last/size' (got " +
                 (range ? QuoteBytes(*range) : std::string("none")) + ")");
    }
    if (got->first != first || got->last != last) {
      return bad("carries the bytes " + std::to_string(got->first) + "-" +
                 std::to_string(got->last) + " (Content-Range), not the ones asked for");
    }
  }
  return Status::Ok();
}

}  // namespace

Status S3Client::GetRange(const std::string& bucket, const std::string& key, uint64_t offset,
                          std::span<std::byte> dst, const std::string& if_match) {
  if (dst.empty()) return Status::Ok();
  auto one = [&](uint64_t at, std::span<std::byte> into) -> Status {
    const uint64_t last = at + into.size() - 1;
    S3Call call{.op = S3Op::kGet, .method = "GET", .bucket = bucket, .key = key};
    call.headers.emplace_back("Range", "bytes=" + std::to_string(at) + "-" + std::to_string(last));
    if (!if_match.empty()) call.headers.emplace_back("If-Match", if_match);
    call.sink = into;
    call.range = std::pair{at, last};
    // A reply with other bytes than asked for (a short body, or a 206 for another range: a
    // faulty proxy or middlebox) is retried like a 5xx, then is kDataLoss naming the object and
    // the range. Never accepted: a safetensors file has no checksum to catch it.
    const std::string where =
        Uri(bucket, key) + " bytes " + std::to_string(at) + "-" + std::to_string(last);
    call.check_reply = [&](const HttpResponse& response) {
      return CheckRangedReply(response, at, last, into.size(), where);
    };
    S3CallResult r = Execute(call);
    if (r.status.code() == StatusCode::kFailedPrecondition) {
      return Rewrap(r.status, StatusCode::kDataLoss,
                    Uri(bucket, key) + " changed since it was opened (ETag " + if_match + ")");
    }
    return r.status;
  };
  const uint64_t chunk = options_.read_chunk_bytes;
  if (dst.size() <= chunk) return one(offset, dst);
  // Several ranged GETs in flight: the pool runs all chunks but the first, which this thread
  // runs itself.
  const size_t count = static_cast<size_t>((dst.size() + chunk - 1) / chunk);
  std::vector<Status> statuses(count);
  Latch done(count - 1);
  for (size_t i = 1; i < count; ++i) {
    pool_->Submit([&, i] {
      const uint64_t begin = i * chunk;
      statuses[i] =
          one(offset + begin, dst.subspan(begin, std::min<uint64_t>(chunk, dst.size() - begin)));
      done.CountDown();
    });
  }
  statuses[0] = one(offset, dst.subspan(0, chunk));
  done.Wait();
  for (const Status& s : statuses) TESSERA_RETURN_IF_ERROR(s);
  return Status::Ok();
}

Result<std::string> S3Client::GetObject(const std::string& bucket, const std::string& key) {
  S3CallResult r = Execute(S3Call{.op = S3Op::kGet, .method = "GET", .bucket = bucket, .key = key});
  TESSERA_RETURN_IF_ERROR(r.status);
  return std::move(r.response.body);
}

Result<ObjectPrefix> S3Client::GetPrefix(const std::string& bucket, const std::string& key,
                                         size_t max_bytes) {
  if (max_bytes == 0) {
    TESSERA_ASSIGN_OR_RETURN(ObjectInfo info, HeadObject(bucket, key));
    return ObjectPrefix{std::move(info), {}};
  }
  // Uninitialised: a manifest's prefix may be 8 MiB, of which a reply fills a few KiB.
  std::unique_ptr<std::byte[]> buffer(new std::byte[max_bytes]);
  S3Call call{.op = S3Op::kGet, .method = "GET", .bucket = bucket, .key = key};
  call.headers.emplace_back("Range", "bytes=0-" + std::to_string(max_bytes - 1));
  call.sink = std::span<std::byte>(buffer.get(), max_bytes);
  call.range = std::pair<uint64_t, uint64_t>{0, max_bytes - 1};
  const std::string where = Uri(bucket, key) + " bytes 0-" + std::to_string(max_bytes - 1);
  uint64_t size = 0;
  // The reply is the object's head: a 206 for bytes 0-(n-1) of an object of a known size,
  // with n = min(max_bytes, size) bytes; or a 200 with the whole object (a server that ignores
  // Range), which fit the buffer (a longer one fails in the transport as too long).
  call.check_reply = [&](const HttpResponse& response) -> Status {
    const auto bad = [&](const std::string& why) {
      return DataLoss(where + ": HTTP " + std::to_string(response.status) + " " + why);
    };
    if (response.status == 200) {
      size = response.body_bytes;
      return Status::Ok();
    }
    if (response.status != 206) return bad("(expected 206)");
    const std::string* header = response.Header("content-range");
    const std::optional<ContentRange> range = ParseContentRange(header);
    if (!range || !range->size) {
      return bad("without a Content-Range of the form 'bytes 0-last/size' (got " +
                 (header ? QuoteBytes(*header) : std::string("none")) + ")");
    }
    const uint64_t expected = std::min<uint64_t>(max_bytes, *range->size);
    if (range->first != 0 || range->last + 1 != expected || response.body_bytes != expected) {
      return bad("carries " + std::to_string(response.body_bytes) + " bytes as " +
                 QuoteBytes(*header) + ", not the first " + std::to_string(expected) +
                 " bytes of the object");
    }
    size = *range->size;
    return Status::Ok();
  };
  S3CallResult r = Execute(call);
  if (!r.status.ok()) {
    // 416: no byte 0, an empty object. Too long: a server that ignored Range sent a whole
    // object larger than the prefix. HeadObject then says what a HEAD says.
    if (r.response.status == 416 || r.reply_too_long) {
      TESSERA_ASSIGN_OR_RETURN(ObjectInfo info, HeadObject(bucket, key));
      return ObjectPrefix{std::move(info), {}};
    }
    if (r.status.code() == StatusCode::kNotFound) {
      return NotFound(Uri(bucket, key) + ": no such object (" + r.status.message() + ")");
    }
    return r.status;
  }
  ObjectPrefix prefix;
  prefix.info.size = size;
  if (const std::string* etag = r.response.Header("etag")) prefix.info.etag = *etag;
  const size_t got = static_cast<size_t>(std::min<uint64_t>(size, max_bytes));
  prefix.bytes.assign(reinterpret_cast<const char*>(buffer.get()), got);
  return prefix;
}

Status S3Client::PutObject(const std::string& bucket, const std::string& key,
                           std::span<const std::byte> bytes, bool create_only) {
  const std::string crc = Crc32cBase64(Crc32c(bytes));
  S3Call call{.op = S3Op::kPut, .method = "PUT", .bucket = bucket, .key = key, .body = bytes};
  call.headers = {{"x-amz-checksum-crc32c", crc}, {"x-amz-sdk-checksum-algorithm", "CRC32C"}};
  if (create_only) call.headers.emplace_back("If-None-Match", "*");
  S3CallResult r = Execute(call);
  if (r.status.ok()) return r.status;
  if (r.status.code() == StatusCode::kFailedPrecondition && create_only) {
    // 412: the object exists. When an earlier try's reply was lost, it may be ours.
    if (r.maybe_applied_earlier && ObjectHolds(bucket, key, bytes, crc).value_or(false)) {
      return Status::Ok();
    }
    return Rewrap(r.status, StatusCode::kAlreadyExists,
                  Uri(bucket, key) + " already exists (a create-only PUT with If-None-Match: *)");
  }
  if (!r.maybe_applied) return r.status;
  // Every try failed, and one may have landed (its reply lost after sending, or a 5xx): a
  // commit (a manifest's Publish) must not report a failure when it committed, so the object
  // is looked at. These bytes there: the PUT took effect.
  Result<bool> landed = ObjectHolds(bucket, key, bytes, crc);
  if (landed.ok() && *landed) return Status::Ok();
  if (!landed.ok()) {
    return Status(r.status.code(),
                  r.status.message() + "; the PUT may have committed (a reply was lost, and " +
                      "looking at " + Uri(bucket, key) + " failed too: " +
                      landed.status().message() + "); ask IsCommitted before saving again");
  }
  return r.status;
}

Result<bool> S3Client::ObjectHolds(const std::string& bucket, const std::string& key,
                                   std::span<const std::byte> bytes, const std::string& crc) {
  Result<ObjectInfo> there = HeadObject(bucket, key, /*with_checksum=*/true);
  if (there.status().code() == StatusCode::kNotFound) return false;
  TESSERA_RETURN_IF_ERROR(there.status());
  if (there->size != bytes.size()) return false;
  if (!there->checksum_crc32c.empty()) return there->checksum_crc32c == crc;
  // A server that keeps no CRC-32C: a single-part object's ETag is its MD5.
  return Unquote(there->etag) == Md5Hex(std::span<const uint8_t>(
                                     reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
}

Status S3Client::DeleteObject(const std::string& bucket, const std::string& key) {
  return Execute(S3Call{.op = S3Op::kDelete, .method = "DELETE", .bucket = bucket, .key = key})
      .status;
}

Status S3Client::DeleteObjects(const std::string& bucket, const std::vector<std::string>& keys) {
  for (size_t begin = 0; begin < keys.size(); begin += 1000) {
    const std::vector<std::string> batch(keys.begin() + begin,
                                         keys.begin() + std::min(keys.size(), begin + 1000));
    const std::string body = DeleteObjectsBody(batch);
    S3Call call{
        .op = S3Op::kDeleteObjects, .method = "POST", .bucket = bucket, .body = AsBytes(body)};
    call.query = {{"delete", ""}};
    // S3 requires Content-MD5 or a checksum on this request.
    call.headers = {{"Content-Type", "application/xml"},
                    {"x-amz-checksum-crc32c", Crc32cBase64(Crc32c(AsBytes(body)))},
                    {"x-amz-sdk-checksum-algorithm", "CRC32C"}};
    S3CallResult r = Execute(call);
    TESSERA_RETURN_IF_ERROR(r.status);
    TESSERA_ASSIGN_OR_RETURN(std::vector<DeleteError> errors, ParseDeleteResult(r.response.body));
    if (!errors.empty()) {
      return IOError("S3 DeleteObjects: " + Uri(bucket, errors[0].key) + ": " + errors[0].code +
                     ": " + errors[0].message + " (" + std::to_string(errors.size()) + " keys of " +
                     std::to_string(batch.size()) + " not deleted)");
    }
  }
  return Status::Ok();
}

Result<ListPage> S3Client::ListObjectsPage(const std::string& bucket, const std::string& prefix,
                                           const std::string& delimiter,
                                           const std::string& continuation_token, int max_keys) {
  S3Call call{.op = S3Op::kList, .method = "GET", .bucket = bucket};
  call.query = {{"list-type", "2"},
                {"encoding-type", "url"},
                {"max-keys", std::to_string(max_keys)},
                {"prefix", prefix}};
  if (!delimiter.empty()) call.query.emplace_back("delimiter", delimiter);
  if (!continuation_token.empty())
    call.query.emplace_back("continuation-token", continuation_token);
  S3CallResult r = Execute(call);
  if (!r.status.ok()) {
    return r.status.WithContext("listing " + Uri(bucket, prefix) + "*");
  }
  Result<ListPage> page = ParseListObjectsV2(r.response.body);
  if (!page.ok()) return page.status().WithContext("listing " + Uri(bucket, prefix) + "*");
  return page;
}

namespace {

// Every name a listing returns must lie under the prefix listed (and a common prefix must end
// with the delimiter): a server that returns anything else is not trusted with the names of a
// checkpoint's files (a shorter name made substr throw, and the process abort).
Status CheckListedNames(const ListPage& page, const std::string& where, const std::string& prefix,
                        const std::string& delimiter) {
  const auto bad = [&](const std::string& what, const std::string& name) {
    return DataLoss("listing " + where + "*: the server returned the " + what + " " +
                    QuoteBytes(name) + ", which is not under the prefix listed");
  };
  for (const ListedObject& o : page.objects) {
    if (!o.key.starts_with(prefix)) return bad("key", o.key);
  }
  for (const std::string& p : page.common_prefixes) {
    if (!p.starts_with(prefix) || p.size() <= prefix.size() ||
        (!delimiter.empty() && !p.ends_with(delimiter))) {
      return bad("common prefix", p);
    }
  }
  return Status::Ok();
}

// Pages in a row that end "truncated" without a single entry before the listing gives up: a
// real server returns at least one entry per page (max-keys >= 1).
constexpr int kMaxEmptyTruncatedPages = 100;

}  // namespace

Result<ListResult> S3Client::ListObjects(const std::string& bucket, const std::string& prefix,
                                         const std::string& delimiter, size_t limit) {
  ListResult all;
  std::string token;
  std::set<std::string> tokens_seen;  // a token seen twice would page forever
  int empty_pages = 0;
  do {
    const int max_keys = limit == 0 ? 1000 : static_cast<int>(std::min<size_t>(1000, limit));
    TESSERA_ASSIGN_OR_RETURN(ListPage page,
                             ListObjectsPage(bucket, prefix, delimiter, token, max_keys));
    TESSERA_RETURN_IF_ERROR(CheckListedNames(page, Uri(bucket, prefix), prefix, delimiter));
    const bool empty = page.objects.empty() && page.common_prefixes.empty();
    for (auto& o : page.objects) all.objects.push_back(std::move(o));
    for (auto& p : page.common_prefixes) all.common_prefixes.push_back(std::move(p));
    token = page.truncated ? page.next_continuation_token : "";
    if (token.empty()) break;
    if (!tokens_seen.insert(token).second) {
      return DataLoss("listing " + Uri(bucket, prefix) +
                      "*: the server sent the same continuation token twice (a listing that "
                      "would never end) after " +
                      std::to_string(all.objects.size() + all.common_prefixes.size()) + " entries");
    }
    empty_pages = empty ? empty_pages + 1 : 0;
    if (empty_pages > kMaxEmptyTruncatedPages) {
      return DataLoss("listing " + Uri(bucket, prefix) + "*: the server sent " +
                      std::to_string(empty_pages) +
                      " truncated pages in a row without an entry (a listing that may never end)");
    }
  } while (limit == 0 || all.objects.size() + all.common_prefixes.size() < limit);
  return all;
}

Result<std::string> S3Client::CreateMultipartUpload(const std::string& bucket,
                                                    const std::string& key) {
  S3Call call{.op = S3Op::kCreateMultipart, .method = "POST", .bucket = bucket, .key = key};
  call.query = {{"uploads", ""}};
  call.headers = {{"x-amz-checksum-algorithm", "CRC32C"}};
  S3CallResult r = Execute(call);
  TESSERA_RETURN_IF_ERROR(r.status);
  Result<std::string> id = ParseInitiateMultipartUpload(r.response.body);
  if (!id.ok()) return id.status().WithContext(Uri(bucket, key));
  return id;
}

Result<CompletedPart> S3Client::UploadPart(const std::string& bucket, const std::string& key,
                                           const std::string& upload_id, int number,
                                           std::span<const std::byte> bytes,
                                           uint64_t object_offset) {
  CompletedPart part{.number = number, .checksum_crc32c = Crc32cBase64(Crc32c(bytes))};
  S3Call call{
      .op = S3Op::kUploadPart, .method = "PUT", .bucket = bucket, .key = key, .body = bytes};
  call.query = {{"partNumber", std::to_string(number)}, {"uploadId", upload_id}};
  if (!bytes.empty()) call.range = std::pair{object_offset, object_offset + bytes.size() - 1};
  call.headers = {{"x-amz-checksum-crc32c", part.checksum_crc32c},
                  {"x-amz-sdk-checksum-algorithm", "CRC32C"}};
  S3CallResult r = Execute(call);
  if (!r.status.ok()) return r.status.WithContext("part " + std::to_string(number));
  const std::string* etag = r.response.Header("etag");
  if (etag == nullptr || etag->empty()) {
    return DataLoss(Uri(bucket, key) + " part " + std::to_string(number) +
                    ": the UploadPart reply has no ETag");
  }
  part.etag = *etag;
  return part;
}

Status S3Client::CompleteMultipartUpload(const std::string& bucket, const std::string& key,
                                         const std::string& upload_id,
                                         const std::vector<CompletedPart>& parts, bool create_only,
                                         uint64_t size) {
  const std::string body = CompleteMultipartUploadBody(parts);
  S3Call call{.op = S3Op::kCompleteMultipart,
              .method = "POST",
              .bucket = bucket,
              .key = key,
              .body = AsBytes(body)};
  call.query = {{"uploadId", upload_id}};
  // Without it the server may not read the body at all (moto answers 500).
  call.headers = {{"Content-Type", "application/xml"}};
  if (create_only) call.headers.emplace_back("If-None-Match", "*");
  bool maybe_applied = false;
  for (int attempt = 1;; ++attempt) {
    S3CallResult r = Execute(call);
    maybe_applied = maybe_applied || r.maybe_applied_earlier;
    if (r.status.ok()) {
      TESSERA_ASSIGN_OR_RETURN(CompleteResult done, ParseCompleteMultipartUpload(r.response.body));
      if (done.error.code.empty()) return Status::Ok();
      // A 200 whose body is an error: the completion failed after the reply started.
      maybe_applied = true;
      if ((done.error.code == "InternalError" || done.error.code == "SlowDown") &&
          attempt < options_.retry.max_attempts) {
        std::this_thread::sleep_for(options_.retry.base_delay * attempt);
        continue;
      }
      return IOError("S3 CompleteMultipartUpload " + Uri(bucket, key) + ": " + done.error.code +
                     ": " + done.error.message);
    }
    const bool lost_race = r.status.code() == StatusCode::kFailedPrecondition;
    const bool gone = r.status.code() == StatusCode::kNotFound && r.error.code == "NoSuchUpload";
    if ((lost_race || gone) && maybe_applied) {
      // An earlier try's reply was lost: the object may be ours. Its checksum (or ETag)
      // says so.
      Result<ObjectInfo> there = HeadObject(bucket, key, /*with_checksum=*/true);
      if (there.ok() && there->size == size) {
        Result<std::string> composite = CompositeCrc32c(parts);
        if ((!there->checksum_crc32c.empty() && composite.ok() &&
             there->checksum_crc32c == *composite) ||
            (there->checksum_crc32c.empty() && Unquote(there->etag) == MultipartEtag(parts))) {
          return Status::Ok();
        }
      }
    }
    if (lost_race && create_only) {
      return Rewrap(r.status, StatusCode::kAlreadyExists,
                    Uri(bucket, key) +
                        " already exists (a create-only CompleteMultipartUpload with "
                        "If-None-Match: *)");
    }
    return r.status;
  }
}

Status S3Client::AbortMultipartUpload(const std::string& bucket, const std::string& key,
                                      const std::string& upload_id) {
  S3Call call{.op = S3Op::kAbortMultipart, .method = "DELETE", .bucket = bucket, .key = key};
  call.query = {{"uploadId", upload_id}};
  S3CallResult r = Execute(call);
  if (r.status.code() == StatusCode::kNotFound && r.error.code == "NoSuchUpload") {
    return Status::Ok();  // already gone
  }
  return r.status;
}

Result<std::vector<UploadListing::Upload>> S3Client::ListMultipartUploads(
    const std::string& bucket, const std::string& prefix) {
  std::vector<UploadListing::Upload> uploads;
  std::string key_marker, id_marker;
  while (true) {
    S3Call call{.op = S3Op::kListMultipart, .method = "GET", .bucket = bucket};
    call.query = {{"uploads", ""}, {"prefix", prefix}, {"encoding-type", "url"}};
    if (!key_marker.empty()) call.query.emplace_back("key-marker", key_marker);
    if (!id_marker.empty()) call.query.emplace_back("upload-id-marker", id_marker);
    S3CallResult r = Execute(call);
    TESSERA_RETURN_IF_ERROR(r.status);
    TESSERA_ASSIGN_OR_RETURN(UploadListing page, ParseListMultipartUploads(r.response.body));
    for (auto& u : page.uploads) uploads.push_back(std::move(u));
    if (!page.truncated) return uploads;
    key_marker = page.next_key_marker;
    id_marker = page.next_upload_id_marker;
  }
}

Result<int> S3Client::AbortIncompleteUploads(const std::string& bucket, const std::string& prefix,
                                             std::chrono::seconds older_than) {
  TESSERA_ASSIGN_OR_RETURN(auto uploads, ListMultipartUploads(bucket, prefix));
  const std::time_t now = std::time(nullptr);
  int aborted = 0;
  for (const auto& u : uploads) {
    const std::optional<std::time_t> started = ParseIso8601(u.initiated);
    // An upload whose start time does not parse is left alone: its age is unknown.
    if (!started || now - *started < older_than.count()) continue;
    TESSERA_RETURN_IF_ERROR(AbortMultipartUpload(bucket, u.key, u.upload_id));
    ++aborted;
  }
  return aborted;
}

Status S3Client::CreateBucket(const std::string& bucket) {
  std::string body;
  if (options_.config.region != "us-east-1") {
    body =
        "<CreateBucketConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
        "<LocationConstraint>" +
        options_.config.region + "</LocationConstraint></CreateBucketConfiguration>";
  }
  S3Call call{.op = S3Op::kOther, .method = "PUT", .bucket = bucket, .body = AsBytes(body)};
  return Execute(call).status;
}

}  // namespace tessera::s3
