#include "format/testing/raw_dir_format.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checksum.h"
#include "core/hex.h"
#include "format/bounded_json.h"
#include "format/registry.h"
#include "format/tessera/names.h"
#include "format/tessera/tessera_format.h"
#include "tessera/sharded_tensor.h"

namespace tessera::testing {
namespace {

using json = nlohmann::json;

constexpr char kName[] = "raw_dir";
constexpr int kVersion = 1;
constexpr std::string_view kDataPrefix = "raw_dir-";
constexpr std::string_view kDataSuffix = ".bin";
// The index's first bytes, before the checksum's 16 hex digits, and those between them and the
// "index" value (which the index's last byte, '}', closes).
constexpr std::string_view kHead = "{\"xxh3\":\"";
constexpr std::string_view kMiddle = "\",\"index\":";
constexpr size_t kChecksumDigits = 16;
// An index longer than this is refused before it is read.
constexpr uint64_t kMaxIndexBytes = 256u << 20;

// ---- File names.

std::string DataName(const std::string& save_id, int rank, int file_index,
                     const std::string& attempt) {
  return std::string(kDataPrefix) + save_id + "-r" + std::to_string(rank) +
         (attempt.empty() ? "" : "-a" + attempt) + "-f" + std::to_string(file_index) +
         std::string(kDataSuffix);
}

// The save id of a data file name ("raw_dir-<id>-r..."), "" for any other name.
std::string SaveIdOfName(std::string_view name) {
  if (!name.starts_with(kDataPrefix) || !name.ends_with(kDataSuffix)) return "";
  name.remove_prefix(kDataPrefix.size());
  const size_t dash = name.find("-r");
  if (dash == std::string_view::npos || dash == 0) return "";
  return std::string(name.substr(0, dash));
}

bool IsDataFile(std::string_view name) { return !SaveIdOfName(name).empty(); }

// ---- The index: reading.

bool ParseHex64(std::string_view digits, uint64_t* out) {
  if (digits.size() != kChecksumDigits) return false;
  uint64_t value = 0;
  for (char c : digits) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    value = value << 4 | static_cast<uint64_t>(d);
  }
  *out = value;
  return true;
}

// The fields of one JSON object of the index at `path`, every error naming the path and where
// in the index (`where`, e.g. "tensors[3]").
class Fields {
 public:
  Fields(const json& object, std::string path, std::string where)
      : object_(object), path_(std::move(path)), where_(std::move(where)) {}

  Status Bad(const std::string& what) const {
    return DataLoss(path_ + ": " + where_ + (where_.empty() ? "" : ": ") + what);
  }
  Result<const json*> Get(const char* field) const {
    if (!object_.is_object()) return Bad("is not a JSON object");
    const auto it = object_.find(field);
    if (it == object_.end()) return Bad(std::string("has no \"") + field + "\"");
    return &*it;
  }
  Result<uint64_t> U64(const char* field,
                       uint64_t max = std::numeric_limits<uint64_t>::max()) const {
    TESSERA_ASSIGN_OR_RETURN(const json* v, Get(field));
    if (!v->is_number_unsigned() || v->get<uint64_t>() > max) {
      return Bad(std::string("\"") + field + "\" is not an integer from 0 to " +
                 std::to_string(max));
    }
    return v->get<uint64_t>();
  }
  Result<std::string> String(const char* field) const {
    TESSERA_ASSIGN_OR_RETURN(const json* v, Get(field));
    if (!v->is_string()) return Bad(std::string("\"") + field + "\" is not a string");
    return v->get<std::string>();
  }
  Result<bool> Bool(const char* field) const {
    TESSERA_ASSIGN_OR_RETURN(const json* v, Get(field));
    if (!v->is_boolean()) return Bad(std::string("\"") + field + "\" is not true or false");
    return v->get<bool>();
  }
  Result<const json*> Array(const char* field) const {
    TESSERA_ASSIGN_OR_RETURN(const json* v, Get(field));
    if (!v->is_array()) return Bad(std::string("\"") + field + "\" is not an array");
    return v;
  }
  // An array of at most `max` non-negative integers, each at most INT64_MAX.
  Result<std::vector<int64_t>> Dims(const char* field, size_t max) const {
    TESSERA_ASSIGN_OR_RETURN(const json* v, Array(field));
    if (v->size() > max) return Bad(std::string("\"") + field + "\" has too many dimensions");
    std::vector<int64_t> dims;
    for (const json& d : *v) {
      if (!d.is_number_unsigned() ||
          d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Bad(std::string("\"") + field + "\" holds something other than a dimension");
      }
      dims.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
    return dims;
  }
  Result<uint64_t> Checksum(const json& v) const {
    uint64_t value = 0;
    if (!v.is_string() || !ParseHex64(v.get_ref<const std::string&>(), &value)) {
      return Bad("a checksum is not 16 lowercase hex digits");
    }
    return value;
  }

 private:
  const json& object_;
  std::string path_;
  std::string where_;
};

// The byte length of `sizes` elements of `dtype`, or nullopt when it overflows.
std::optional<uint64_t> ByteLength(std::span<const int64_t> sizes, DType dtype) {
  uint64_t n = DTypeSize(dtype);
  for (int64_t s : sizes) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(s), &n)) return std::nullopt;
  }
  return n;
}

// Parses the index at `path` (its bytes `bytes`) into Metadata: the envelope and its checksum,
// then every field. Checks what is raw_dir's own: one item per file, at offset 0, as long as
// the file; a checksum per block. What every index must satisfy (sorted keys, chunks covering
// their tensors, ...) is CheckAsManifest's. Errors: kDataLoss naming `path`.
Result<Metadata> ParseIndex(std::span<const uint8_t> bytes, const std::string& path) {
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  const size_t body_begin = kHead.size() + kChecksumDigits + kMiddle.size();
  if (text.size() < body_begin + 1 || !text.starts_with(kHead) ||
      text.substr(kHead.size() + kChecksumDigits, kMiddle.size()) != kMiddle ||
      text.back() != '}') {
    return DataLoss(path +
                    " is not a raw_dir index ({\"xxh3\":\"<16 hex digits>\",\"index\":...})");
  }
  uint64_t stored = 0;
  if (!ParseHex64(text.substr(kHead.size(), kChecksumDigits), &stored)) {
    return DataLoss(path + ": its checksum is not 16 lowercase hex digits");
  }
  const std::string_view body = text.substr(body_begin, text.size() - body_begin - 1);
  if (const uint64_t actual = ::tessera::Checksum(body.data(), body.size()); actual != stored) {
    return DataLoss(path + ": checksum mismatch (stored " + Hex64(stored) + ", computed " +
                    Hex64(actual) + "): the index is damaged");
  }
  TESSERA_ASSIGN_OR_RETURN(const json doc, ParseBoundedJson(body, path));
  const Fields top(doc, path, "");
  TESSERA_ASSIGN_OR_RETURN(const uint64_t version, top.U64("version"));
  if (version != kVersion) {
    return DataLoss(path + ": raw_dir index version " + std::to_string(version) +
                    ", this reader knows " + std::to_string(kVersion));
  }
  Metadata m;
  m.format = kRawDirFormatId;
  m.format_version = 0;
  TESSERA_ASSIGN_OR_RETURN(m.save_id, top.String("save_id"));
  TESSERA_ASSIGN_OR_RETURN(const uint64_t ranks,
                           top.U64("num_ranks", std::numeric_limits<int32_t>::max()));
  m.num_ranks = static_cast<int32_t>(ranks);
  TESSERA_ASSIGN_OR_RETURN(const uint64_t time,
                           top.U64("save_time_unix_ms", std::numeric_limits<int64_t>::max()));
  m.save_time_unix_ms = static_cast<int64_t>(time);
  TESSERA_ASSIGN_OR_RETURN(const std::string checksum, top.String("checksum"));
  if (checksum == "xxh3") {
    m.checksum = ChecksumKind::kXxh3_64;
  } else if (checksum == "none") {
    m.checksum = ChecksumKind::kNone;
  } else {
    return top.Bad("\"checksum\" is neither \"xxh3\" nor \"none\"");
  }
  TESSERA_ASSIGN_OR_RETURN(m.checksum_block_bytes, top.U64("checksum_block_bytes"));

  TESSERA_ASSIGN_OR_RETURN(const json* user, top.Get("user_metadata"));
  if (!user->is_object()) return top.Bad("\"user_metadata\" is not an object");
  for (const auto& [k, v] : user->items()) {
    if (!v.is_string()) return top.Bad("user_metadata[\"" + k + "\"] is not a string");
    m.user_metadata[k] = v.get<std::string>();
  }
  TESSERA_ASSIGN_OR_RETURN(const json* prefixes, top.Array("separate_prefixes"));
  for (const json& p : *prefixes) {
    if (!p.is_string()) return top.Bad("\"separate_prefixes\" holds something other than a string");
    m.separate_prefixes.push_back(p.get<std::string>());
  }

  TESSERA_ASSIGN_OR_RETURN(const json* files, top.Array("files"));
  for (size_t f = 0; f < files->size(); ++f) {
    const Fields file((*files)[f], path, "files[" + std::to_string(f) + "]");
    FileInfo info;
    TESSERA_ASSIGN_OR_RETURN(info.name, file.String("name"));
    if (Status s = CheckDataFileName(info.name); !s.ok()) return file.Bad(s.message());
    TESSERA_ASSIGN_OR_RETURN(info.size, file.U64("size"));
    m.files.push_back(std::move(info));
  }
  // One item per file, the whole file.
  std::vector<uint32_t> items_in(m.files.size(), 0);
  auto locate = [&](const Fields& where, uint64_t length) -> Result<ByteLocation> {
    if (m.files.empty()) return where.Bad("names a file, and there are none");
    TESSERA_ASSIGN_OR_RETURN(const uint64_t f, where.U64("file", m.files.size() - 1));
    if (++items_in[f] > 1) return where.Bad("file " + m.files[f].name + " holds a second item");
    if (m.files[f].size != length) {
      return where.Bad("file " + m.files[f].name + " is " + std::to_string(m.files[f].size) +
                       " bytes, and its item " + std::to_string(length));
    }
    return ByteLocation{static_cast<uint32_t>(f), 0, length, 0};
  };
  const bool xxh3 = m.checksum == ChecksumKind::kXxh3_64;

  TESSERA_ASSIGN_OR_RETURN(const json* tensors, top.Array("tensors"));
  for (size_t t = 0; t < tensors->size(); ++t) {
    const Fields tensor((*tensors)[t], path, "tensors[" + std::to_string(t) + "]");
    TensorInfo info;
    TESSERA_ASSIGN_OR_RETURN(info.key, tensor.String("key"));
    TESSERA_ASSIGN_OR_RETURN(const std::string dtype, tensor.String("dtype"));
    Result<DType> parsed = DTypeFromName(dtype);
    if (!parsed.ok()) return tensor.Bad("unknown dtype \"" + dtype + "\"");
    info.dtype = *parsed;
    TESSERA_ASSIGN_OR_RETURN(info.global_shape, tensor.Dims("shape", kMaxTensorRank));
    TESSERA_ASSIGN_OR_RETURN(info.partial, tensor.Bool("partial"));
    TESSERA_ASSIGN_OR_RETURN(const json* chunks, tensor.Array("chunks"));
    for (size_t c = 0; c < chunks->size(); ++c) {
      const Fields chunk((*chunks)[c], path,
                         "tensors[" + std::to_string(t) + "].chunks[" + std::to_string(c) + "]");
      ChunkInfo out;
      TESSERA_ASSIGN_OR_RETURN(out.box.offsets, chunk.Dims("offsets", kMaxTensorRank));
      TESSERA_ASSIGN_OR_RETURN(out.box.sizes, chunk.Dims("sizes", kMaxTensorRank));
      const std::optional<uint64_t> length = ByteLength(out.box.sizes, info.dtype);
      if (!length) return chunk.Bad("its byte length overflows");
      TESSERA_ASSIGN_OR_RETURN(out.location, locate(chunk, *length));
      TESSERA_ASSIGN_OR_RETURN(const json* sums, chunk.Array("checksums"));
      const uint64_t blocks = xxh3 ? NumChecksumBlocks(*length, m.checksum_block_bytes) : 0;
      if (sums->size() != blocks) {
        return chunk.Bad("has " + std::to_string(sums->size()) + " checksums, its blocks " +
                         std::to_string(blocks));
      }
      for (size_t b = 0; b < sums->size(); ++b) {
        TESSERA_ASSIGN_OR_RETURN(const uint64_t sum, chunk.Checksum((*sums)[b]));
        if (b == 0) {
          out.location.checksum = sum;
        } else {
          out.block_checksums.push_back(sum);
        }
      }
      info.chunks.push_back(std::move(out));
    }
    m.tensors.push_back(std::move(info));
  }

  TESSERA_ASSIGN_OR_RETURN(const json* objects, top.Array("objects"));
  for (size_t o = 0; o < objects->size(); ++o) {
    const Fields object((*objects)[o], path, "objects[" + std::to_string(o) + "]");
    ObjectInfo info;
    TESSERA_ASSIGN_OR_RETURN(info.key, object.String("key"));
    TESSERA_ASSIGN_OR_RETURN(const uint64_t encoding,
                             object.U64("encoding", static_cast<uint64_t>(ObjectEncoding::kJson)));
    info.encoding = static_cast<ObjectEncoding>(encoding);
    TESSERA_ASSIGN_OR_RETURN(const uint64_t length, object.U64("length"));
    TESSERA_ASSIGN_OR_RETURN(info.location, locate(object, length));
    if (xxh3) {
      TESSERA_ASSIGN_OR_RETURN(const json* sum, object.Get("checksum"));
      TESSERA_ASSIGN_OR_RETURN(info.location.checksum, object.Checksum(*sum));
    }
    m.objects.push_back(std::move(info));
  }
  for (size_t f = 0; f < m.files.size(); ++f) {
    if (items_in[f] == 0) return DataLoss(path + ": file " + m.files[f].name + " holds no item");
  }
  return m;
}

// The whole of the index at `path`, bounded.
Result<Bytes> ReadIndexBytes(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  if (file->size() > kMaxIndexBytes) {
    return DataLoss(path + " is " + std::to_string(file->size()) + " bytes, more than the " +
                    std::to_string(kMaxIndexBytes) + " a raw_dir index may have");
  }
  Bytes bytes(file->size());
  TESSERA_RETURN_IF_ERROR(file->ReadAt(0, bytes.data(), bytes.size()));
  return bytes;
}

// ---- The index: writing.

// `metadata` as ParseIndex gives it back (what a commit keeps of it).
Metadata AsStored(const Metadata& metadata) {
  Metadata m = metadata;
  m.format = kRawDirFormatId;
  m.format_version = 0;
  m.commit_seq = 0;
  m.rank_local_reference = false;
  m.part_rank = -1;
  return m;
}

// The "index" value of `m`. InvalidArgument naming the key of an item raw_dir cannot store as
// it is (wrapped, transposed, not alone in its file).
Result<json> IndexBody(const Metadata& m) {
  std::vector<uint32_t> items_in(m.files.size(), 0);
  auto check = [&](const std::string& what, const ByteLocation& where) -> Status {
    if (where.file_index >= m.files.size() || where.offset != 0 ||
        where.length != m.files[where.file_index].size || items_in[where.file_index]++ > 0) {
      return InvalidArgument(what + " is not the one item of a file of its own");
    }
    return Status::Ok();
  };
  const bool xxh3 = m.checksum == ChecksumKind::kXxh3_64;
  if (!xxh3 && m.checksum != ChecksumKind::kNone) {
    return InvalidArgument("raw_dir stores XXH3-64 checksums or none");
  }
  json body = json::object();
  body["version"] = kVersion;
  body["save_id"] = m.save_id;
  body["num_ranks"] = static_cast<uint64_t>(std::max(m.num_ranks, 0));
  body["save_time_unix_ms"] = static_cast<uint64_t>(std::max<int64_t>(m.save_time_unix_ms, 0));
  body["checksum"] = xxh3 ? "xxh3" : "none";
  body["checksum_block_bytes"] = m.checksum_block_bytes;
  body["user_metadata"] = json::object();
  for (const auto& [k, v] : m.user_metadata) body["user_metadata"][k] = v;
  body["separate_prefixes"] = m.separate_prefixes;
  json& files = body["files"] = json::array();
  for (const FileInfo& f : m.files) files.push_back({{"name", f.name}, {"size", f.size}});
  json& tensors = body["tensors"] = json::array();
  for (const TensorInfo& t : m.tensors) {
    json chunks = json::array();
    for (const ChunkInfo& c : t.chunks) {
      const std::string what = "key '" + t.key + "' box " + c.box.ToString();
      if (c.encoding != ChunkEncoding::kRaw || !c.storage_order.empty() || c.payload_offset != 0) {
        return InvalidArgument(what + " is not stored raw and row-major");
      }
      TESSERA_RETURN_IF_ERROR(check(what, c.location));
      json sums = json::array();
      if (xxh3) {
        sums.push_back(Hex64(c.location.checksum));
        for (uint64_t b : c.block_checksums) sums.push_back(Hex64(b));
      }
      chunks.push_back({{"offsets", c.box.offsets},
                        {"sizes", c.box.sizes},
                        {"file", c.location.file_index},
                        {"checksums", std::move(sums)}});
    }
    tensors.push_back({{"key", t.key},
                       {"dtype", std::string(DTypeName(t.dtype))},
                       {"shape", t.global_shape},
                       {"partial", t.partial},
                       {"chunks", std::move(chunks)}});
  }
  json& objects = body["objects"] = json::array();
  for (const ObjectInfo& o : m.objects) {
    TESSERA_RETURN_IF_ERROR(check("object '" + o.key + "'", o.location));
    json object = {{"key", o.key},
                   {"encoding", static_cast<uint64_t>(o.encoding)},
                   {"file", o.location.file_index},
                   {"length", o.location.length}};
    if (xxh3) object["checksum"] = Hex64(o.location.checksum);
    objects.push_back(std::move(object));
  }
  return body;
}

// ---- The writer.

// A file of one item: its bytes from offset 0, no header, no framing.
class RawDataFile final : public DataFileEncoder {
 public:
  explicit RawDataFile(uint64_t num_bytes) : num_bytes_(num_bytes) {}
  const Bytes& header() const override { return header_; }
  uint64_t ItemOffset(size_t, uint64_t) const override { return 0; }
  Result<std::unique_ptr<ItemWriter>> BeginItem(WritableFile& out, size_t,
                                                uint64_t offset) const override {
    return std::unique_ptr<ItemWriter>(new RawItemWriter(out, offset, num_bytes_));
  }
  std::optional<ItemPlacement> PlaceItem(size_t, uint64_t offset) const override {
    return ItemPlacement{offset, num_bytes_};
  }

 private:
  uint64_t num_bytes_;
  Bytes header_;  // empty
};

class RawDirWriter final : public FormatWriter {
 public:
  std::string DataFileName(const std::string& save_id, int rank, int file_index,
                           const std::string& attempt) const override {
    return DataName(save_id, rank, file_index, attempt);
  }
  // A directory another format has committed in would be read as that format's checkpoint.
  Status CheckTarget(const std::string& dir, const std::vector<std::string>& names) const override {
    std::vector<std::string> sorted = names;
    std::sort(sorted.begin(), sorted.end());
    for (const Format* format : ChooseFormats(sorted).committed) {
      if (format->id() == kRawDirFormatId) continue;
      return FailedPrecondition(dir + " holds a " + format->name() + " checkpoint (" +
                                std::string(format->commit_description()) +
                                "); a raw_dir save there would be hidden by it");
    }
    return Status::Ok();
  }
  bool OneFilePerItem() const override { return true; }
  bool EngineChecksums() const override { return true; }
  Result<std::unique_ptr<DataFileEncoder>> NewDataFile(const std::vector<ItemToWrite>& items,
                                                       const std::string&) const override {
    if (items.size() != 1) {
      return Internal("a raw_dir data file holds one item, not " + std::to_string(items.size()));
    }
    return std::unique_ptr<DataFileEncoder>(new RawDataFile(items[0].num_bytes));
  }

  std::string_view index_description() const override { return kRawDirIndexName; }
  bool NumberedCommits() const override { return false; }
  std::string IndexFileName(uint64_t) const override { return kRawDirIndexName; }
  void FinishIndex(Metadata& metadata) const override { metadata.format = kRawDirFormatId; }
  Result<Bytes> EncodeIndex(const Metadata& metadata, const std::string& location) const override {
    const std::string path = JoinPath(location, kRawDirIndexName);
    TESSERA_ASSIGN_OR_RETURN(const json body, IndexBody(metadata));
    // Invalid UTF-8 (which JSON cannot hold) is replaced, and then fails the check below.
    const std::string text = body.dump(-1, ' ', false, json::error_handler_t::replace);
    std::string file = std::string(kHead) + Hex64(::tessera::Checksum(text.data(), text.size())) +
                       std::string(kMiddle) + text + "}";
    Bytes bytes(file.begin(), file.end());
    // What a reader will make of it: ReadIndex's parse and checks.
    TESSERA_ASSIGN_OR_RETURN(const Metadata parsed, ParseIndex(bytes, path));
    TESSERA_ASSIGN_OR_RETURN(const Metadata checked, CheckAsManifest(parsed, path));
    if (!(checked == AsStored(metadata))) return DataLoss(path + " does not read back as written");
    return bytes;
  }
  bool ReplacedByLaterSave(std::span<const uint8_t> stored, const std::string& save_id,
                           const std::string& path) const override {
    Result<Metadata> now = ParseIndex(stored, path);
    if (!now.ok()) return false;
    return std::none_of(now->files.begin(), now->files.end(),
                        [&](const FileInfo& f) { return SaveIdOfName(f.name) == save_id; });
  }
  std::string SaveIdOfFile(std::string_view name) const override { return SaveIdOfName(name); }
  Result<std::set<std::string>> FilesOfIndex(std::span<const uint8_t> stored,
                                             const std::string& path) const override {
    TESSERA_ASSIGN_OR_RETURN(const Metadata m, ParseIndex(stored, path));
    std::set<std::string> files;
    for (const FileInfo& f : m.files) files.insert(f.name);
    return files;
  }
};

// ---- The format.

class RawDirFormatImpl final : public Format {
 public:
  CheckpointFormat id() const override { return kRawDirFormatId; }
  const char* name() const override { return kName; }
  std::string_view commit_description() const override { return kRawDirIndexName; }

  // The index is written last: data files without it are a save that did not finish.
  DirectoryClaim Claim(const std::vector<std::string>& names) const override {
    if (std::binary_search(names.begin(), names.end(), kRawDirIndexName)) {
      return DirectoryClaim::kCommitted;
    }
    return std::any_of(names.begin(), names.end(),
                       [](const std::string& n) { return IsDataFile(n); })
               ? DirectoryClaim::kUnfinished
               : DirectoryClaim::kNone;
  }
  bool CountsFile(std::string_view name, DirectoryClaim) const override {
    return name == kRawDirIndexName || IsDataFile(name);
  }

  Result<FormatIndex> ReadIndex(Storage& storage, const std::string& dir,
                                const std::vector<std::string>&) const override {
    const std::string path = JoinPath(dir, kRawDirIndexName);
    TESSERA_ASSIGN_OR_RETURN(const Bytes bytes, ReadIndexBytes(storage, path));
    TESSERA_ASSIGN_OR_RETURN(const Metadata parsed, ParseIndex(bytes, path));
    TESSERA_ASSIGN_OR_RETURN(Metadata checked, CheckAsManifest(parsed, path));
    return FormatIndex{dir, std::move(checked)};
  }

  bool DataFilesHaveHeaders() const override { return false; }

  bool CanWrite() const override { return true; }
  Result<std::unique_ptr<FormatWriter>> NewWriter(const SaveOptions&, bool) const override {
    return std::unique_ptr<FormatWriter>(new RawDirWriter());
  }
};

}  // namespace

const Format& RawDirFormat() {
  static const RawDirFormatImpl format;
  return format;
}

}  // namespace tessera::testing
