#include "format/tessera/manifest.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <unordered_set>
#include <utility>

#include "core/checksum.h"
#include "core/tiling.h"
#include "format/tessera/manifest_internal.h"

namespace tessera {

// The manifest and the data files are little-endian; fixed-size fields are copied with memcpy.
static_assert(std::endian::native == std::endian::little,
              "tessera's format code assumes a little-endian host");

namespace {

using namespace manifest_internal;

// docs/FORMAT.md, section 3. All of these are permanent.
constexpr char kMagic[8] = {'T', 'S', 'R', 'M', 'A', 'N', 'I', 'F'};
constexpr size_t kLocationBytes = 28;  // version 1: u32 file_index, u64 offset, length, checksum

// ---- encoding ------------------------------------------------------------------------------

class Writer {
 public:
  explicit Writer(uint8_t* p) : p_(p) {}
  void Raw(const void* data, size_t n) {
    if (n) std::memcpy(p_, data, n);
    p_ += n;
  }
  void U8(uint8_t v) { *p_++ = v; }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    Raw(s.data(), s.size());
  }
  void Location(const ByteLocation& l) {
    U32(l.file_index);
    U64(l.offset);
    U64(l.length);
    U64(l.checksum);
  }
  // Writes exactly `rank` values of `v`; a vector of another length (an invalid box) is written
  // as -1s so that the decoder rejects it rather than reading a different box.
  void Dims(std::span<const int64_t> v, size_t rank) {
    if (v.size() == rank) {
      Raw(v.data(), 8 * rank);
    } else {
      for (size_t i = 0; i < rank; ++i) U64(~uint64_t{0});
    }
  }

 private:
  uint8_t* p_;
};

size_t EncodedRank(const TensorInfo& t) { return std::min<size_t>(t.global_shape.size(), 255); }

uint64_t BodySize(const Metadata& m) {
  uint64_t n = 4 + m.save_id.size() + 4;
  n += 8;
  for (const FileInfo& f : m.files) n += 4 + f.name.size() + 8;
  n += 8;
  for (const auto& [k, v] : m.user_metadata) n += 4 + k.size() + 4 + v.size();
  n += 8;
  for (const TensorInfo& t : m.tensors) {
    const size_t rank = EncodedRank(t);
    n += 4 + t.key.size() + 1 + 1 + 1 + 8 * rank + 8;
    n += t.chunks.size() * (16 * rank + kLocationBytes);
  }
  n += 8;
  for (const ObjectInfo& o : m.objects) n += 4 + o.key.size() + kLocationBytes;
  return n;
}

// ---- decoding ------------------------------------------------------------------------------

class Decoder {
 public:
  Decoder(const uint8_t* body, size_t size, std::string_view source)
      : begin_(body), p_(body), end_(body + size), source_(source) {}

  Result<Metadata> Decode(uint32_t version);

 private:
  Status Corrupt(const std::string& what) const {
    return DataLoss(std::string(source_) + ": corrupt manifest: " + what);
  }
  Status PastEnd(const char* what, uint64_t need) const {
    return Corrupt(std::string(what) + " at body offset " + std::to_string(p_ - begin_) +
                   " needs " + std::to_string(need) + " bytes, but only " +
                   std::to_string(end_ - p_) + " remain");
  }
  size_t Remaining() const { return static_cast<size_t>(end_ - p_); }

  // Each reads one field, or returns an error naming `what`.
  Status Need(uint64_t n, const char* what) const {
    return n <= Remaining() ? Status() : PastEnd(what, n);
  }
  Status ReadU32(uint32_t* v, const char* what) {
    TESSERA_RETURN_IF_ERROR(Need(4, what));
    *v = LoadLE<uint32_t>(p_);
    p_ += 4;
    return Status();
  }
  Status ReadU64(uint64_t* v, const char* what) {
    TESSERA_RETURN_IF_ERROR(Need(8, what));
    *v = LoadLE<uint64_t>(p_);
    p_ += 8;
    return Status();
  }
  Status ReadString(std::string* s, const char* what) {
    uint32_t n;
    TESSERA_RETURN_IF_ERROR(ReadU32(&n, what));
    TESSERA_RETURN_IF_ERROR(Need(n, what));
    s->assign(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return Status();
  }
  // Reads a count of records of at least `min_record` bytes each, refusing counts that cannot
  // fit in what is left (so nothing is allocated for a corrupt count).
  Status ReadCount(uint64_t* count, uint64_t min_record, const char* what) {
    TESSERA_RETURN_IF_ERROR(ReadU64(count, what));
    if (*count > Remaining() / min_record) {
      return Corrupt(std::string(what) + " " + std::to_string(*count) + " needs at least " +
                     std::to_string(min_record) + " bytes each, but only " +
                     std::to_string(Remaining()) + " bytes remain");
    }
    return Status();
  }
  // Decodes a location (Need() already checked) and validates it against the file table.
  // `where()` names the owner; it is called only on error.
  template <typename Where>
  Status ReadLocation(ByteLocation* l, const Metadata& m, const Where& where) {
    l->file_index = LoadLE<uint32_t>(p_);
    l->offset = LoadLE<uint64_t>(p_ + 4);
    l->length = LoadLE<uint64_t>(p_ + 12);
    l->checksum = LoadLE<uint64_t>(p_ + 20);
    p_ += kLocationBytes;
    if (l->file_index >= m.files.size()) [[unlikely]] {
      return Corrupt(where() + ": file index " + std::to_string(l->file_index) + " out of range (" +
                     std::to_string(m.files.size()) + " files)");
    }
    const uint64_t file_size = m.files[l->file_index].size;
    if (l->length > file_size || l->offset > file_size - l->length) [[unlikely]] {
      return Corrupt(where() + ": bytes [" + std::to_string(l->offset) + ", +" +
                     std::to_string(l->length) + ") lie outside file " +
                     QuoteBytes(m.files[l->file_index].name) + " (" + std::to_string(file_size) +
                     " bytes)");
    }
    return Status();
  }
  Status ReadTensor(TensorInfo* t, const Metadata& m);

  const uint8_t* const begin_;
  const uint8_t* p_;
  const uint8_t* const end_;
  std::string_view source_;
};

Status Decoder::ReadTensor(TensorInfo* t, const Metadata& m) {
  TESSERA_RETURN_IF_ERROR(ReadString(&t->key, "tensor key"));
  auto where = [t] { return "tensor " + QuoteBytes(t->key); };
  TESSERA_RETURN_IF_ERROR(Need(3, "tensor dtype, rank and flags"));
  const uint8_t dtype = p_[0];
  const uint32_t rank = p_[1];
  const uint8_t tensor_flags = p_[2];
  p_ += 3;
  if (tensor_flags & ~kTensorPartial) {
    return Corrupt(where() + ": unknown tensor flags " + std::to_string(tensor_flags));
  }
  t->partial = (tensor_flags & kTensorPartial) != 0;
  if (!IsValidDType(dtype)) {
    std::string what = where() + ": unknown dtype value " + std::to_string(dtype);
    if (dtype == 0) return Corrupt(what);
    return Unimplemented(std::string(source_) + ": " + what +
                         " (written by a newer tessera? this build knows values 1.." +
                         std::to_string(static_cast<int>(kAllDTypes[std::size(kAllDTypes) - 1])) +
                         ")");
  }
  t->dtype = static_cast<DType>(dtype);
  if (rank > kMaxRank) {
    return Corrupt(where() + ": rank " + std::to_string(rank) + " exceeds the limit of " +
                   std::to_string(kMaxRank));
  }
  TESSERA_RETURN_IF_ERROR(Need(8 * rank, "tensor global shape"));
  t->global_shape.resize(rank);
  if (rank) std::memcpy(t->global_shape.data(), p_, 8 * rank);
  p_ += 8 * rank;
  const int64_t* shape = t->global_shape.data();
  for (uint32_t d = 0; d < rank; ++d) {
    if (shape[d] < 0) {
      return Corrupt(where() + ": global shape " + ShapeToString(t->global_shape) +
                     " has a negative dimension");
    }
  }
  uint64_t elements;
  uint64_t tensor_bytes;
  const uint64_t dtype_size = DTypeSize(t->dtype);
  if (!CountElements(shape, rank, &elements) ||
      __builtin_mul_overflow(elements, dtype_size, &tensor_bytes) ||
      tensor_bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Corrupt(where() + ": global shape " + ShapeToString(t->global_shape) + " is too large");
  }

  const uint64_t record = 16 * rank + kLocationBytes;
  uint64_t count;
  TESSERA_RETURN_IF_ERROR(ReadCount(&count, record, "chunk count"));
  t->chunks.resize(count);
  uint64_t covered = 0;
  for (uint64_t i = 0; i < count; ++i) {
    ChunkInfo& c = t->chunks[i];
    // ReadCount checked that all `count` records fit.
    c.box.offsets.resize(rank);
    c.box.sizes.resize(rank);
    if (rank) {
      std::memcpy(c.box.offsets.data(), p_, 8 * rank);
      std::memcpy(c.box.sizes.data(), p_ + 8 * rank, 8 * rank);
    }
    p_ += 16 * rank;
    const int64_t* off = c.box.offsets.data();
    const int64_t* size = c.box.sizes.data();
    bool inside = true;
    for (uint32_t d = 0; d < rank; ++d) {
      inside &= off[d] >= 0 && size[d] >= 0 && off[d] <= shape[d] - size[d];
    }
    if (!inside) [[unlikely]] {
      return Corrupt(where() + " chunk " + std::to_string(i) + ": box " +
                     UncheckedBoxString(c.box) + " lies outside the global shape " +
                     ShapeToString(t->global_shape));
    }
    uint64_t chunk_elements = 0;
    CountElements(size, rank, &chunk_elements);  // <= elements: cannot overflow
    if (Status s =
            ReadLocation(&c.location, m, [&] { return where() + " chunk " + std::to_string(i); });
        !s.ok()) [[unlikely]] {
      return s;
    }
    if (c.location.length != chunk_elements * dtype_size) [[unlikely]] {
      return Corrupt(where() + " chunk " + std::to_string(i) + " " + c.box.ToString() +
                     ": length " + std::to_string(c.location.length) + " bytes, but " +
                     std::to_string(chunk_elements) + " elements of " +
                     std::string(DTypeName(t->dtype)) + " take " +
                     std::to_string(chunk_elements * dtype_size));
    }
    covered += chunk_elements;
    if (covered > elements) [[unlikely]]
      break;
  }
  if (covered > elements || (covered < elements && !t->partial)) {
    return Corrupt(
        where() + ": its " + std::to_string(count) + " chunks hold " +
        (covered > elements ? "more than " + std::to_string(elements) : std::to_string(covered)) +
        " elements, but the global shape " + ShapeToString(t->global_shape) + " has " +
        std::to_string(elements));
  }
  return Status();
}

Result<Metadata> Decoder::Decode(uint32_t version) {
  Metadata m;
  m.format_version = version;

  TESSERA_RETURN_IF_ERROR(ReadString(&m.save_id, "save_id"));
  uint32_t num_ranks;
  TESSERA_RETURN_IF_ERROR(ReadU32(&num_ranks, "num_ranks"));
  if (num_ranks > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
    return Corrupt("num_ranks " + std::to_string(num_ranks) + " is too large");
  }
  m.num_ranks = static_cast<int32_t>(num_ranks);

  // File table.
  uint64_t count;
  TESSERA_RETURN_IF_ERROR(ReadCount(&count, 12, "file count"));
  if (count > std::numeric_limits<uint32_t>::max()) {
    return Corrupt("file count " + std::to_string(count) + " exceeds 2^32-1");
  }
  m.files.resize(count);
  std::unordered_set<std::string_view> names;
  names.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    FileInfo& f = m.files[i];
    TESSERA_RETURN_IF_ERROR(ReadString(&f.name, "file name"));
    TESSERA_RETURN_IF_ERROR(ReadU64(&f.size, "file size"));
    if (Status s = CheckDataFileName(f.name); !s.ok()) {
      return Corrupt("file " + std::to_string(i) + ": " + s.message() +
                     " (it would escape the checkpoint directory)");
    }
    if (!names.insert(f.name).second) {
      return Corrupt("file " + std::to_string(i) + ": name " + QuoteBytes(f.name) +
                     " appears twice in the file table");
    }
  }

  // User metadata.
  TESSERA_RETURN_IF_ERROR(ReadCount(&count, 8, "user metadata count"));
  const std::string* prev_key = nullptr;
  for (uint64_t i = 0; i < count; ++i) {
    std::string key;
    std::string value;
    TESSERA_RETURN_IF_ERROR(ReadString(&key, "user metadata key"));
    TESSERA_RETURN_IF_ERROR(ReadString(&value, "user metadata value"));
    if (prev_key && !(*prev_key < key)) {
      return Corrupt("user metadata key " + QuoteBytes(key) + " is not after " +
                     QuoteBytes(*prev_key) + " (keys must be sorted and unique)");
    }
    prev_key =
        &m.user_metadata.emplace_hint(m.user_metadata.end(), std::move(key), std::move(value))
             ->first;
  }

  // Tensors.
  TESSERA_RETURN_IF_ERROR(ReadCount(&count, 4 + 2 + 8, "tensor count"));
  m.tensors.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    TESSERA_RETURN_IF_ERROR(ReadTensor(&m.tensors[i], m));
    if (i > 0 && !(m.tensors[i - 1].key < m.tensors[i].key)) {
      return Corrupt("tensor key " + QuoteBytes(m.tensors[i].key) + " is not after " +
                     QuoteBytes(m.tensors[i - 1].key) + " (keys must be sorted and unique)");
    }
  }

  // Objects.
  TESSERA_RETURN_IF_ERROR(ReadCount(&count, 4 + kLocationBytes, "object count"));
  m.objects.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    ObjectInfo& o = m.objects[i];
    TESSERA_RETURN_IF_ERROR(ReadString(&o.key, "object key"));
    TESSERA_RETURN_IF_ERROR(Need(kLocationBytes, "object location"));
    TESSERA_RETURN_IF_ERROR(
        ReadLocation(&o.location, m, [&] { return "object " + QuoteBytes(o.key); }));
    if (i > 0 && !(m.objects[i - 1].key < o.key)) {
      return Corrupt("object key " + QuoteBytes(o.key) + " is not after " +
                     QuoteBytes(m.objects[i - 1].key) + " (keys must be sorted and unique)");
    }
  }

  if (p_ != end_) {
    return Corrupt(std::to_string(Remaining()) + " unexpected bytes at the end of the body");
  }

  return m;
}

}  // namespace

namespace manifest_internal {

bool CountElements(const int64_t* dims, size_t rank, uint64_t* out) {
  for (size_t i = 0; i < rank; ++i) {
    if (dims[i] == 0) {
      *out = 0;
      return true;
    }
  }
  uint64_t n = 1;
  for (size_t i = 0; i < rank; ++i) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(dims[i]), &n)) return false;
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = n;
  return true;
}

// "[o:end, ...]", "[o:+size, ...]" where o + size would overflow.
std::string UncheckedBoxString(const Box& box) {
  std::string out = "[";
  for (size_t d = 0; d < box.rank(); ++d) {
    if (d) out += ", ";
    int64_t end;
    if (__builtin_add_overflow(box.offsets[d], box.sizes[d], &end)) {
      out += std::to_string(box.offsets[d]) + ":+" + std::to_string(box.sizes[d]);
    } else {
      out += std::to_string(box.offsets[d]) + ":" + std::to_string(end);
    }
  }
  return out + "]";
}

Status ValidateDecoded(const Metadata& m, std::string_view source) {
  auto corrupt = [&](const std::string& what) {
    return DataLoss(std::string(source) + ": corrupt manifest: " + what);
  };
  if (m.part_rank >= 0 && m.part_rank >= m.num_ranks) {
    return corrupt("part rank " + std::to_string(m.part_rank) + " is not below num_ranks " +
                   std::to_string(m.num_ranks));
  }
  if (m.rank_local_reference &&
      (!m.files.empty() || !m.tensors.empty() || !m.objects.empty() || m.num_ranks < 1)) {
    return corrupt(
        "a reference to a rank-local save must name at least one rank and hold no "
        "file, tensor or object");
  }
  if (m.save_id.empty() || m.save_id.size() > kMaxSaveIdBytes) {
    return corrupt("save_id " + QuoteBytes(m.save_id) + " must have 1.." +
                   std::to_string(kMaxSaveIdBytes) + " bytes");
  }
  for (char c : m.save_id) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-' ||
          c == '_')) {
      return corrupt("save_id " + QuoteBytes(m.save_id) + " holds a character other than " +
                     "[0-9A-Za-z_-]");
    }
  }
  // A key names a tensor or an object, not both (both lists are sorted).
  auto t = m.tensors.begin();
  for (const ObjectInfo& o : m.objects) {
    while (t != m.tensors.end() && t->key < o.key) ++t;
    if (t != m.tensors.end() && t->key == o.key) {
      return corrupt("key " + QuoteBytes(o.key) + " names both a tensor and an object");
    }
  }
  // The chunks of every tensor are disjoint and, unless it is partial, cover it: the element
  // counts adding up (checked while decoding) is not enough, overlapping chunks would leave
  // elements that no chunk holds.
  for (const TensorInfo& tensor : m.tensors) {
    // A rank's part of a rank-local save holds only the chunks that rank wrote.
    const bool require_coverage = !tensor.partial && m.part_rank < 0;
    if (auto failure = CheckTiling(tensor.chunks, tensor.global_shape, require_coverage)) {
      return corrupt("tensor " + QuoteBytes(tensor.key) + ": " + failure->problem());
    }
  }
  return Status();
}

Result<Metadata> DecodeBodyVersion1(std::span<const uint8_t> body, std::string_view source) {
  return Decoder(body.data(), body.size(), source).Decode(1);
}

}  // namespace manifest_internal

namespace {

Bytes WithHeaderAndChecksum(uint32_t version, const Bytes& body) {
  Bytes out(kHeaderBytes + body.size() + kTrailerBytes);
  Writer w(out.data());
  w.Raw(kMagic, sizeof(kMagic));
  w.U32(version);
  w.U32(0);  // flags
  w.U64(body.size());
  w.Raw(body.data(), body.size());
  w.U64(Checksum(out.data(), kHeaderBytes + body.size()));
  return out;
}

}  // namespace

Bytes EncodeManifest(const Metadata& m) {
  return WithHeaderAndChecksum(kFormatVersion, EncodeBody(m, kFormatVersion, m.format));
}

Bytes EncodeManifestVersion2(const Metadata& m) {
  return WithHeaderAndChecksum(2, EncodeBody(m, 2, m.format));
}

Bytes EncodeCarriedIndex(const Metadata& m) {
  const Bytes manifest = WithHeaderAndChecksum(
      kFormatVersion, EncodeBody(m, kFormatVersion, CheckpointFormat::kTessera));
  Bytes out;
  out.reserve(1 + manifest.size());
  out.push_back(static_cast<uint8_t>(m.format));
  out.insert(out.end(), manifest.begin(), manifest.end());
  return out;
}

Result<Metadata> DecodeCarriedIndex(std::span<const uint8_t> bytes, std::string_view source) {
  if (bytes.empty()) return DataLoss(std::string(source) + ": an empty index");
  TESSERA_ASSIGN_OR_RETURN(Metadata m, DecodeManifest(bytes.subspan(1), source));
  m.format = static_cast<CheckpointFormat>(bytes[0]);
  return m;
}

Bytes EncodeManifestVersion1(const Metadata& m) {
  const uint64_t body = BodySize(m);
  Bytes out(kHeaderBytes + body + kTrailerBytes);
  Writer w(out.data());
  w.Raw(kMagic, sizeof(kMagic));
  w.U32(1);
  w.U32(0);  // flags
  w.U64(body);

  w.Str(m.save_id);
  w.U32(static_cast<uint32_t>(m.num_ranks));
  w.U64(m.files.size());
  for (const FileInfo& f : m.files) {
    w.Str(f.name);
    w.U64(f.size);
  }
  w.U64(m.user_metadata.size());
  for (const auto& [k, v] : m.user_metadata) {
    w.Str(k);
    w.Str(v);
  }
  w.U64(m.tensors.size());
  for (const TensorInfo& t : m.tensors) {
    const size_t rank = EncodedRank(t);
    w.Str(t.key);
    w.U8(static_cast<uint8_t>(t.dtype));
    w.U8(static_cast<uint8_t>(rank));
    w.U8(t.partial ? kTensorPartial : 0);
    w.Dims(t.global_shape, rank);
    w.U64(t.chunks.size());
    for (const ChunkInfo& c : t.chunks) {
      w.Dims(c.box.offsets, rank);
      w.Dims(c.box.sizes, rank);
      w.Location(c.location);
    }
  }
  w.U64(m.objects.size());
  for (const ObjectInfo& o : m.objects) {
    w.Str(o.key);
    w.Location(o.location);
  }
  w.U64(Checksum(out.data(), kHeaderBytes + body));
  return out;
}

Result<uint64_t> CheckManifestHeader(std::span<const uint8_t> prefix, uint64_t file_size,
                                     std::string_view source) {
  const std::string src(source);
  const uint64_t size = file_size;
  const uint8_t* data = prefix.data();
  if (prefix.size() < std::min<uint64_t>(size, kManifestHeaderBytes)) {
    return Internal(src + ": CheckManifestHeader needs the first " +
                    std::to_string(std::min<uint64_t>(size, kManifestHeaderBytes)) +
                    " bytes, got " + std::to_string(prefix.size()));
  }
  if (size < sizeof(kMagic) || std::memcmp(data, kMagic, sizeof(kMagic)) != 0) {
    return DataLoss(src + ": not a tessera manifest (the file does not start with \"TSRMANIF\"" +
                    (size < sizeof(kMagic) ? "; it has only " + std::to_string(size) + " bytes"
                                           : std::string()) +
                    ")");
  }
  if (size < 12) {
    return DataLoss(src + ": manifest truncated: " + std::to_string(size) +
                    " bytes, too short to hold the format version");
  }
  const uint32_t version = LoadLE<uint32_t>(data + 8);
  if (version > kFormatVersion) {
    return Unimplemented(src + ": manifest format version " + std::to_string(version) +
                         " is newer than this build of tessera supports (" +
                         std::to_string(kFormatVersion) + ")");
  }
  if (version == 0) return DataLoss(src + ": invalid manifest format version 0");
  if (size < kHeaderBytes + kTrailerBytes) {
    return DataLoss(src + ": manifest truncated: " + std::to_string(size) + " bytes, fewer than " +
                    std::to_string(kHeaderBytes + kTrailerBytes));
  }
  const uint64_t body_length = LoadLE<uint64_t>(data + 16);
  const uint64_t available = size - kHeaderBytes - kTrailerBytes;
  if (body_length > available) {
    return DataLoss(src + ": manifest truncated: its header promises " +
                    std::to_string(kHeaderBytes + body_length + kTrailerBytes) +
                    " bytes, the file has " + std::to_string(size));
  }
  if (body_length < available) {
    return DataLoss(src + ": manifest has " + std::to_string(available - body_length) +
                    " unexpected bytes after its checksum");
  }
  if (size > kMaxManifestBytes) {
    return DataLoss(src + ": manifest of " + std::to_string(size) + " bytes is larger than the " +
                    std::to_string(kMaxManifestBytes) +
                    " bytes this build of tessera reads (a corrupt header?)");
  }
  return size;
}

Status ManifestChecksumMismatch(std::string_view source) {
  return DataLoss(std::string(source) + ": manifest checksum mismatch (file corrupt or truncated)");
}

Result<Metadata> DecodeManifest(std::span<const uint8_t> bytes, std::string_view source) {
  const std::string src(source);
  const size_t size = bytes.size();
  const uint8_t* data = bytes.data();
  TESSERA_RETURN_IF_ERROR(CheckManifestHeader(bytes, size, source).status());
  const uint64_t body_length = LoadLE<uint64_t>(data + 16);
  const uint32_t version = LoadLE<uint32_t>(data + 8);
  const uint64_t stored = LoadLE<uint64_t>(data + kHeaderBytes + body_length);
  if (Checksum(data, kHeaderBytes + body_length) != stored) return ManifestChecksumMismatch(src);
  const uint32_t flags = LoadLE<uint32_t>(data + 12);
  if (flags != 0) {
    char hex[16];
    std::snprintf(hex, sizeof(hex), "0x%x", flags);
    return Unimplemented(src + ": manifest sets flags " + hex +
                         " that this build of tessera does not know (format version " +
                         std::to_string(version) + " defines none)");
  }
  const std::span<const uint8_t> body(data + kHeaderBytes, body_length);
  Result<Metadata> metadata =
      version == 1 ? DecodeBodyVersion1(body, source) : DecodeBody(body, source, version);
  if (!metadata.ok()) return metadata;
  TESSERA_RETURN_IF_ERROR(ValidateDecoded(*metadata, source));
  return metadata;
}

}  // namespace tessera
