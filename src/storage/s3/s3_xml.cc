#include "storage/s3/s3_xml.h"

#include <pugixml.hpp>

#include <charconv>

namespace tessera::s3 {
namespace {

// Parses `body`; the document's root element must be `root`.
Result<pugi::xml_node> Parse(pugi::xml_document& doc, std::string_view body, const char* root) {
  const pugi::xml_parse_result parsed =
      doc.load_buffer(body.data(), body.size(), pugi::parse_default, pugi::encoding_utf8);
  if (!parsed) {
    return DataLoss(std::string("malformed XML in S3's ") + root + " reply at byte " +
                    std::to_string(parsed.offset) + ": " + parsed.description());
  }
  pugi::xml_node node = doc.child(root);
  if (!node) {
    return DataLoss(std::string("S3's reply is not a ") + root + " document (root element '" +
                    doc.document_element().name() + "')");
  }
  return node;
}

std::string Text(const pugi::xml_node& node, const char* child) {
  return node.child(child).text().get();
}

bool IsTrue(const pugi::xml_node& node, const char* child) { return Text(node, child) == "true"; }

Result<uint64_t> ParseSize(const std::string& s, const std::string& key) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty()) {
    return DataLoss("S3 listed key '" + key + "' with size '" + s + "', not a byte count");
  }
  return v;
}

void AppendEscaped(std::string& out, std::string_view s) {
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out.push_back(c);
    }
  }
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::optional<ContentRange> ParseContentRange(const std::string* header) {
  if (header == nullptr || !std::string_view(*header).starts_with("bytes ")) return std::nullopt;
  const std::string_view spec = std::string_view(*header).substr(6);
  const size_t dash = spec.find('-');
  const size_t slash = spec.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || slash < dash) {
    return std::nullopt;
  }
  auto number = [](std::string_view text, uint64_t& out) {
    const auto r = std::from_chars(text.data(), text.data() + text.size(), out);
    return !text.empty() && r.ec == std::errc() && r.ptr == text.data() + text.size();
  };
  ContentRange range;
  if (!number(spec.substr(0, dash), range.first) ||
      !number(spec.substr(dash + 1, slash - dash - 1), range.last) || range.last < range.first) {
    return std::nullopt;
  }
  const std::string_view size = spec.substr(slash + 1);
  if (size != "*") {
    uint64_t n = 0;
    if (!number(size, n) || n <= range.last) return std::nullopt;
    range.size = n;
  }
  return range;
}

std::string UrlDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out.push_back(' ');
    } else if (s[i] == '%' && i + 2 < s.size() && HexValue(s[i + 1]) >= 0 &&
               HexValue(s[i + 2]) >= 0) {
      out.push_back(static_cast<char>(HexValue(s[i + 1]) * 16 + HexValue(s[i + 2])));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

S3ErrorBody ParseErrorBody(std::string_view body) {
  S3ErrorBody error;
  pugi::xml_document doc;
  if (body.empty() || !doc.load_buffer(body.data(), body.size())) return error;
  pugi::xml_node node = doc.child("Error");
  if (!node) node = doc.child("ErrorResponse").child("Error");  // IAM's query protocol
  error.code = Text(node, "Code");
  error.message = Text(node, "Message");
  error.request_id = Text(node, "RequestId");
  return error;
}

Result<ListPage> ParseListObjectsV2(std::string_view body) {
  pugi::xml_document doc;
  TESSERA_ASSIGN_OR_RETURN(pugi::xml_node root, Parse(doc, body, "ListBucketResult"));
  ListPage page;
  for (pugi::xml_node c : root.children("Contents")) {
    ListedObject o;
    o.key = UrlDecode(Text(c, "Key"));
    TESSERA_ASSIGN_OR_RETURN(o.size, ParseSize(Text(c, "Size"), o.key));
    o.etag = Text(c, "ETag");
    page.objects.push_back(std::move(o));
  }
  for (pugi::xml_node p : root.children("CommonPrefixes")) {
    page.common_prefixes.push_back(UrlDecode(Text(p, "Prefix")));
  }
  page.truncated = IsTrue(root, "IsTruncated");
  page.next_continuation_token = Text(root, "NextContinuationToken");
  if (page.truncated && page.next_continuation_token.empty()) {
    return DataLoss("S3's ListObjectsV2 reply is truncated but has no NextContinuationToken");
  }
  return page;
}

Result<std::string> ParseInitiateMultipartUpload(std::string_view body) {
  pugi::xml_document doc;
  TESSERA_ASSIGN_OR_RETURN(pugi::xml_node root, Parse(doc, body, "InitiateMultipartUploadResult"));
  std::string id = Text(root, "UploadId");
  if (id.empty()) return DataLoss("S3's InitiateMultipartUploadResult has no UploadId");
  return id;
}

Result<CompleteResult> ParseCompleteMultipartUpload(std::string_view body) {
  CompleteResult result;
  pugi::xml_document doc;
  if (!doc.load_buffer(body.data(), body.size())) {
    return DataLoss("malformed XML in S3's CompleteMultipartUpload reply");
  }
  if (doc.child("Error")) {
    result.error = ParseErrorBody(body);
    if (result.error.code.empty()) result.error.code = "InternalError";
    return result;
  }
  pugi::xml_node root = doc.child("CompleteMultipartUploadResult");
  if (!root) return DataLoss("S3's CompleteMultipartUpload reply is not a result document");
  result.etag = Text(root, "ETag");
  return result;
}

Result<std::vector<DeleteError>> ParseDeleteResult(std::string_view body) {
  pugi::xml_document doc;
  TESSERA_ASSIGN_OR_RETURN(pugi::xml_node root, Parse(doc, body, "DeleteResult"));
  std::vector<DeleteError> errors;
  for (pugi::xml_node e : root.children("Error")) {
    errors.push_back(DeleteError{Text(e, "Key"), Text(e, "Code"), Text(e, "Message")});
  }
  return errors;
}

Result<UploadListing> ParseListMultipartUploads(std::string_view body) {
  pugi::xml_document doc;
  TESSERA_ASSIGN_OR_RETURN(pugi::xml_node root, Parse(doc, body, "ListMultipartUploadsResult"));
  UploadListing listing;
  for (pugi::xml_node u : root.children("Upload")) {
    listing.uploads.push_back(UploadListing::Upload{UrlDecode(Text(u, "Key")), Text(u, "UploadId"),
                                                    Text(u, "Initiated")});
  }
  listing.truncated = IsTrue(root, "IsTruncated");
  listing.next_key_marker = UrlDecode(Text(root, "NextKeyMarker"));
  listing.next_upload_id_marker = Text(root, "NextUploadIdMarker");
  if (listing.truncated && listing.next_key_marker.empty() &&
      listing.next_upload_id_marker.empty()) {
    return DataLoss("S3's ListMultipartUploads reply is truncated but has no markers");
  }
  return listing;
}

std::string CompleteMultipartUploadBody(const std::vector<CompletedPart>& parts) {
  std::string out = "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
  for (const CompletedPart& p : parts) {
    out += "<Part><PartNumber>" + std::to_string(p.number) + "</PartNumber><ETag>";
    AppendEscaped(out, p.etag);
    out += "</ETag>";
    if (!p.checksum_crc32c.empty()) {
      out += "<ChecksumCRC32C>" + p.checksum_crc32c + "</ChecksumCRC32C>";
    }
    out += "</Part>";
  }
  out += "</CompleteMultipartUpload>";
  return out;
}

std::string DeleteObjectsBody(const std::vector<std::string>& keys) {
  std::string out = "<Delete xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Quiet>true</Quiet>";
  for (const std::string& key : keys) {
    out += "<Object><Key>";
    AppendEscaped(out, key);
    out += "</Key></Object>";
  }
  out += "</Delete>";
  return out;
}

}  // namespace tessera::s3
