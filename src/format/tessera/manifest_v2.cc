// Manifest format version 2: the compact body (docs/FORMAT.md, section 3.5). Varints, keys
// front-coded against the previous key, chunk boxes delta-coded against the previous chunk,
// chunk lengths derived from their boxes, and byte offsets implied when a piece follows the
// previous piece of its file. About 12-14 bytes a 2-D chunk, checksum included (60 in
// version 1).
#include <algorithm>
#include <limits>
#include <string>
#include <unordered_set>
#include <vector>

#include "format/tessera/manifest.h"
#include "format/tessera/manifest_internal.h"

namespace tessera::manifest_internal {
namespace {

// Chunk flags (u8 before each chunk record). Bit values are permanent.
constexpr uint8_t kSameSizes = 1 << 0;   // sizes equal the previous chunk's (of this tensor)
constexpr uint8_t kNextInFile = 1 << 1;  // offset = end of the previous piece in its file
constexpr uint8_t kSameFile = 1 << 2;    // file index equals the previous chunk's
constexpr uint8_t kHasOrder = 1 << 3;    // a storage order follows
constexpr uint8_t kEncodingShift = 4;    // bits 4-5: ChunkEncoding
constexpr uint8_t kEncodingMask = 3 << 4;
constexpr uint8_t kKnownChunkFlags =
    kSameSizes | kNextInFile | kSameFile | kHasOrder | kEncodingMask;
// Manifest kinds (u8). Permanent.
constexpr uint8_t kWholeCheckpoint = 0;
constexpr uint8_t kRankPart = 1;   // followed by varint part_rank
constexpr uint8_t kReference = 2;  // version 3: places a rank-local save in the sequence
// Smallest block size a writer may declare: smaller blocks would make the manifest larger
// than the data they protect is worth.
constexpr uint64_t kMinChecksumBlockBytes = 4096;

uint64_t ZigZag(int64_t v) {
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}
int64_t UnZigZag(uint64_t v) { return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1); }

// ---- encoding ------------------------------------------------------------------------------

class Encoder {
 public:
  explicit Encoder(Bytes* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(v); }
  void U64(uint64_t v) {
    const size_t at = out_->size();
    out_->resize(at + 8);
    std::memcpy(out_->data() + at, &v, 8);
  }
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      out_->push_back(static_cast<uint8_t>(v) | 0x80);
      v >>= 7;
    }
    out_->push_back(static_cast<uint8_t>(v));
  }
  void Signed(int64_t v) { Varint(ZigZag(v)); }
  void Str(std::string_view s) {
    Varint(s.size());
    out_->insert(out_->end(), s.begin(), s.end());
  }
  // `s` as the length of the prefix it shares with `previous`, then the rest.
  void FrontCoded(std::string_view s, std::string_view previous) {
    const size_t n = std::min(s.size(), previous.size());
    size_t shared = 0;
    while (shared < n && s[shared] == previous[shared]) ++shared;
    Varint(shared);
    Str(s.substr(shared));
  }

 private:
  Bytes* out_;
};

// End of the last piece encoded in each file: a piece starting there has kNextInFile.
class FileCursor {
 public:
  explicit FileCursor(size_t num_files) : next_(num_files, 0) {}
  bool Follows(const ByteLocation& l) const {
    return l.file_index < next_.size() && next_[l.file_index] == l.offset;
  }
  void Advance(const ByteLocation& l) {
    if (l.file_index < next_.size()) next_[l.file_index] = l.offset + l.length;
  }

 private:
  std::vector<uint64_t> next_;
};

void EncodeChunks(const Metadata& m, const TensorInfo& t, Encoder& e, FileCursor& cursor) {
  const size_t rank = t.global_shape.size();
  const bool checksummed = m.checksum != ChecksumKind::kNone;
  std::vector<int64_t> previous_offsets(rank, 0);
  const ChunkInfo* previous = nullptr;
  uint32_t previous_file = 0;
  for (const ChunkInfo& c : t.chunks) {
    // Boxes of another rank than the tensor's are invalid; they are written so that the
    // decoder rejects them (sizes of -1 do not decode as a valid box).
    const bool valid_box = c.box.offsets.size() == rank && c.box.sizes.size() == rank;
    uint8_t flags = static_cast<uint8_t>(static_cast<uint8_t>(c.encoding) << kEncodingShift);
    if (previous && valid_box && c.box.sizes == previous->box.sizes) flags |= kSameSizes;
    if (cursor.Follows(c.location)) flags |= kNextInFile;
    if (previous && c.location.file_index == previous_file) flags |= kSameFile;
    if (!c.storage_order.empty()) flags |= kHasOrder;
    e.U8(flags);
    for (size_t d = 0; d < rank; ++d) {
      const int64_t offset = valid_box ? c.box.offsets[d] : -1;
      e.Signed(static_cast<int64_t>(static_cast<uint64_t>(offset) -
                                    static_cast<uint64_t>(previous_offsets[d])));
      previous_offsets[d] = offset;
    }
    if (!(flags & kSameSizes)) {
      for (size_t d = 0; d < rank; ++d) e.Signed(valid_box ? c.box.sizes[d] : -1);
    }
    if (!(flags & kSameFile)) {
      e.Signed(static_cast<int64_t>(c.location.file_index) - static_cast<int64_t>(previous_file));
    }
    if (!(flags & kNextInFile)) e.Varint(c.location.offset);
    if (c.encoding != ChunkEncoding::kRaw) {
      e.Varint(c.location.length);
      e.Varint(c.payload_offset);
    }
    if (flags & kHasOrder) {
      for (size_t d = 0; d < rank; ++d)
        e.U8(d < c.storage_order.size() ? c.storage_order[d] : 0xFF);
    }
    if (checksummed) {
      e.U64(c.location.checksum);
      for (uint64_t b : c.block_checksums) e.U64(b);
    }
    cursor.Advance(c.location);
    previous = &c;
    previous_file = c.location.file_index;
  }
}

// ---- decoding ------------------------------------------------------------------------------

class DecoderV2 {
 public:
  DecoderV2(std::span<const uint8_t> body, std::string_view source, uint32_t version)
      : begin_(body.data()),
        p_(body.data()),
        end_(body.data() + body.size()),
        source_(source),
        version_(version) {}

  Result<Metadata> Decode();

 private:
  Status Corrupt(const std::string& what) const {
    return DataLoss(std::string(source_) + ": corrupt manifest: " + what);
  }
  Status PastEnd(const char* what) const {
    return Corrupt(std::string(what) + " at body offset " + std::to_string(p_ - begin_) +
                   " runs past the end of the body (" + std::to_string(end_ - begin_) + " bytes)");
  }
  size_t Remaining() const { return static_cast<size_t>(end_ - p_); }

  // Raw readers: false when the input ends first (or, for a varint, runs past 64 bits).
  bool RawU8(uint8_t* v) {
    if (p_ == end_) [[unlikely]]
      return false;
    *v = *p_++;
    return true;
  }
  bool RawVarint(uint64_t* v) {
    if (p_ != end_ && *p_ < 0x80) [[likely]] {  // one byte: the common case
      *v = *p_++;
      return true;
    }
    uint64_t result = 0;
    for (int shift = 0; shift < 64 && p_ != end_; shift += 7) {
      const uint8_t byte = *p_++;
      if (shift == 63 && byte > 1) return false;
      result |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if (!(byte & 0x80)) {
        *v = result;
        return true;
      }
    }
    return false;
  }
  Status BadVarint(const char* what) const {
    return p_ == end_ ? PastEnd(what)
                      : Corrupt(std::string(what) + " at body offset " +
                                std::to_string(p_ - begin_) + " is a varint longer than 64 bits");
  }

  Status U8(uint8_t* v, const char* what) {
    if (!RawU8(v)) [[unlikely]]
      return PastEnd(what);
    return Status();
  }
  Status U64(uint64_t* v, const char* what) {
    if (Remaining() < 8) return PastEnd(what);
    *v = LoadLE<uint64_t>(p_);
    p_ += 8;
    return Status();
  }
  Status Varint(uint64_t* v, const char* what) {
    if (!RawVarint(v)) [[unlikely]]
      return BadVarint(what);
    return Status();
  }
  Status Signed(int64_t* v, const char* what) {
    uint64_t u = 0;
    TESSERA_RETURN_IF_ERROR(Varint(&u, what));
    *v = UnZigZag(u);
    return Status();
  }
  Status Str(std::string* s, const char* what) {
    uint64_t n = 0;
    TESSERA_RETURN_IF_ERROR(Varint(&n, what));
    if (n > Remaining()) return PastEnd(what);
    s->assign(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return Status();
  }
  // A key front-coded against `previous`; the result must sort strictly after it.
  Status FrontCoded(std::string* s, const std::string& previous, bool first, const char* what) {
    uint64_t shared = 0;
    TESSERA_RETURN_IF_ERROR(Varint(&shared, what));
    if (shared > previous.size()) {
      return Corrupt(std::string(what) + ": shares " + std::to_string(shared) +
                     " bytes with the previous one, which has only " +
                     std::to_string(previous.size()));
    }
    std::string suffix;
    TESSERA_RETURN_IF_ERROR(Str(&suffix, what));
    s->assign(previous, 0, shared);
    *s += suffix;
    if (!first && !(previous < *s)) {
      return Corrupt(std::string(what) + " " + QuoteBytes(*s) + " is not after " +
                     QuoteBytes(previous) + " (keys must be sorted and unique)");
    }
    return Status();
  }
  // A count of records of at least `min_record` bytes each: refused when they cannot fit in
  // what is left, so nothing is allocated from a corrupt count.
  Status Count(uint64_t* count, uint64_t min_record, const char* what) {
    TESSERA_RETURN_IF_ERROR(Varint(count, what));
    if (*count > Remaining() / min_record) {
      return Corrupt(std::string(what) + " " + std::to_string(*count) + " needs at least " +
                     std::to_string(min_record) + " bytes each, but only " +
                     std::to_string(Remaining()) + " bytes remain");
    }
    return Status();
  }

  Status Preamble(Metadata& m);
  Status Files(Metadata& m);
  Status Strings(Metadata& m);
  Status Tensor(Metadata& m, TensorInfo& t, const std::string& previous_key, bool first);
  Status Kind(Metadata& m);
  Status Chunk(Metadata& m, TensorInfo& t, size_t index, const std::string& where);
  Status StorageOrder(ChunkInfo& c, size_t rank, const std::string& where);
  Status Location(const Metadata& m, const ByteLocation& l, const std::string& where) const;
  Status Objects(Metadata& m);

  const uint8_t* const begin_;
  const uint8_t* p_;
  const uint8_t* const end_;
  std::string_view source_;
  const uint32_t version_;  // 2 or 3 (3 adds the commit sequence and references)
  std::vector<uint64_t> next_in_file_;
  // State of the chunk being decoded, carried from the previous chunk of the tensor.
  std::vector<int64_t> previous_offsets_;
  const Dims* previous_sizes_ = nullptr;
  uint32_t previous_file_ = 0;
};

Status DecoderV2::Preamble(Metadata& m) {
  uint8_t format = 0, checksum = 0;
  TESSERA_RETURN_IF_ERROR(U8(&format, "source format"));
  TESSERA_RETURN_IF_ERROR(U8(&checksum, "checksum kind"));
  if (format > static_cast<uint8_t>(CheckpointFormat::kSafetensors)) {
    return Corrupt("unknown source format " + std::to_string(format));
  }
  if (checksum > static_cast<uint8_t>(ChecksumKind::kXxh3_64)) {
    return Corrupt("unknown checksum kind " + std::to_string(checksum));
  }
  m.format = static_cast<CheckpointFormat>(format);
  m.checksum = static_cast<ChecksumKind>(checksum);
  TESSERA_RETURN_IF_ERROR(Varint(&m.checksum_block_bytes, "checksum block bytes"));
  if (m.checksum_block_bytes != 0 && m.checksum_block_bytes < kMinChecksumBlockBytes) {
    return Corrupt("checksum block of " + std::to_string(m.checksum_block_bytes) +
                   " bytes is below the minimum of " + std::to_string(kMinChecksumBlockBytes));
  }
  TESSERA_RETURN_IF_ERROR(Kind(m));
  TESSERA_RETURN_IF_ERROR(Str(&m.save_id, "save_id"));
  uint64_t num_ranks = 0, time = 0;
  TESSERA_RETURN_IF_ERROR(Varint(&num_ranks, "num_ranks"));
  if (num_ranks > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return Corrupt("num_ranks " + std::to_string(num_ranks) + " is too large");
  }
  m.num_ranks = static_cast<int32_t>(num_ranks);
  TESSERA_RETURN_IF_ERROR(Varint(&time, "save time"));
  if (time > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Corrupt("save time " + std::to_string(time) + " is too large");
  }
  m.save_time_unix_ms = static_cast<int64_t>(time);
  return Status();
}

// The manifest kind and what follows it: the part rank of a rank manifest, then (version 3)
// the commit sequence number.
Status DecoderV2::Kind(Metadata& m) {
  uint8_t kind = 0;
  TESSERA_RETURN_IF_ERROR(U8(&kind, "manifest kind"));
  if (kind == kRankPart) {
    uint64_t rank = 0;
    TESSERA_RETURN_IF_ERROR(Varint(&rank, "part rank"));
    if (rank > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
      return Corrupt("part rank " + std::to_string(rank) + " is too large");
    }
    m.part_rank = static_cast<int32_t>(rank);
  } else if (kind == kReference && version_ >= 3) {
    m.rank_local_reference = true;
  } else if (kind != kWholeCheckpoint) {
    return Corrupt("unknown manifest kind " + std::to_string(kind) + " (format version " +
                   std::to_string(version_) + ")");
  }
  if (version_ >= 3) TESSERA_RETURN_IF_ERROR(Varint(&m.commit_seq, "commit sequence number"));
  return Status();
}

Status DecoderV2::Files(Metadata& m) {
  uint64_t count = 0;
  TESSERA_RETURN_IF_ERROR(Count(&count, 3, "file count"));
  if (count > std::numeric_limits<uint32_t>::max()) {
    return Corrupt("file count " + std::to_string(count) + " exceeds 2^32-1");
  }
  m.files.resize(count);
  std::unordered_set<std::string_view> names;
  names.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    FileInfo& f = m.files[i];
    uint64_t shared = 0;
    TESSERA_RETURN_IF_ERROR(Varint(&shared, "file name"));
    const std::string& previous = i ? m.files[i - 1].name : f.name;
    if (shared > previous.size()) {
      return Corrupt("file " + std::to_string(i) + ": name shares " + std::to_string(shared) +
                     " bytes with the previous one");
    }
    std::string suffix;
    TESSERA_RETURN_IF_ERROR(Str(&suffix, "file name"));
    f.name = previous.substr(0, shared) + suffix;
    TESSERA_RETURN_IF_ERROR(Varint(&f.size, "file size"));
    if (Status s = CheckDataFileName(f.name); !s.ok()) {
      return Corrupt("file " + std::to_string(i) + ": " + s.message() +
                     " (it would escape the checkpoint directory)");
    }
    if (!names.insert(f.name).second) {
      return Corrupt("file " + std::to_string(i) + ": name " + QuoteBytes(f.name) +
                     " appears twice in the file table");
    }
  }
  next_in_file_.assign(count, 0);
  return Status();
}

// Separate prefixes and user metadata.
Status DecoderV2::Strings(Metadata& m) {
  uint64_t count = 0;
  TESSERA_RETURN_IF_ERROR(Count(&count, 1, "separate prefix count"));
  m.separate_prefixes.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    TESSERA_RETURN_IF_ERROR(Str(&m.separate_prefixes[i], "separate prefix"));
    if (i && !(m.separate_prefixes[i - 1] < m.separate_prefixes[i])) {
      return Corrupt("separate prefix " + QuoteBytes(m.separate_prefixes[i]) +
                     " is not after the previous one (prefixes must be sorted and unique)");
    }
  }
  TESSERA_RETURN_IF_ERROR(Count(&count, 2, "user metadata count"));
  std::string previous;
  for (uint64_t i = 0; i < count; ++i) {
    std::string key, value;
    TESSERA_RETURN_IF_ERROR(Str(&key, "user metadata key"));
    TESSERA_RETURN_IF_ERROR(Str(&value, "user metadata value"));
    if (i && !(previous < key)) {
      return Corrupt("user metadata key " + QuoteBytes(key) + " is not after " +
                     QuoteBytes(previous) + " (keys must be sorted and unique)");
    }
    previous = key;
    m.user_metadata.emplace_hint(m.user_metadata.end(), std::move(key), std::move(value));
  }
  return Status();
}

Status DecoderV2::Location(const Metadata& m, const ByteLocation& l,
                           const std::string& where) const {
  if (l.file_index >= m.files.size()) [[unlikely]] {
    return Corrupt(where + ": file index " + std::to_string(l.file_index) + " out of range (" +
                   std::to_string(m.files.size()) + " files)");
  }
  const uint64_t file_size = m.files[l.file_index].size;
  if (l.length > file_size || l.offset > file_size - l.length) [[unlikely]] {
    return Corrupt(where + ": bytes [" + std::to_string(l.offset) + ", +" +
                   std::to_string(l.length) + ") lie outside file " +
                   QuoteBytes(m.files[l.file_index].name) + " (" + std::to_string(file_size) +
                   " bytes)");
  }
  return Status();
}

Status DecoderV2::Chunk(Metadata& m, TensorInfo& t, size_t index, const std::string& where_t) {
  auto where = [&] { return where_t + " chunk " + std::to_string(index); };
  const size_t rank = t.global_shape.size();
  ChunkInfo& c = t.chunks[index];
  uint8_t flags = 0;
  if (!RawU8(&flags)) return PastEnd("chunk flags");
  if (flags & ~kKnownChunkFlags) [[unlikely]] {
    return Corrupt(where() + ": unknown chunk flags " + std::to_string(flags));
  }
  const uint8_t encoding = (flags & kEncodingMask) >> kEncodingShift;
  if (encoding > static_cast<uint8_t>(ChunkEncoding::kTorchSaveItem)) [[unlikely]] {
    return Corrupt(where() + ": unknown chunk encoding " + std::to_string(encoding));
  }
  c.encoding = static_cast<ChunkEncoding>(encoding);
  if ((flags & (kSameSizes | kSameFile)) && index == 0) [[unlikely]] {
    return Corrupt(where() + ": the first chunk cannot repeat the previous chunk's " +
                   ((flags & kSameSizes) ? "sizes" : "file"));
  }
  c.box.offsets.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    uint64_t delta = 0;
    if (!RawVarint(&delta)) [[unlikely]]
      return BadVarint("chunk offset");
    // Wrapping arithmetic: an out-of-range result is caught by the bounds check below.
    c.box.offsets[d] = static_cast<int64_t>(static_cast<uint64_t>(previous_offsets_[d]) +
                                            static_cast<uint64_t>(UnZigZag(delta)));
    previous_offsets_[d] = c.box.offsets[d];
  }
  if (flags & kSameSizes) {
    c.box.sizes = *previous_sizes_;
  } else {
    c.box.sizes.resize(rank);
    for (size_t d = 0; d < rank; ++d) {
      uint64_t size = 0;
      if (!RawVarint(&size)) [[unlikely]]
        return BadVarint("chunk size");
      c.box.sizes[d] = UnZigZag(size);
    }
  }
  const int64_t* shape = t.global_shape.data();
  for (size_t d = 0; d < rank; ++d) {
    const int64_t off = c.box.offsets[d], size = c.box.sizes[d];
    if (!(off >= 0 && size >= 0 && off <= shape[d] - size)) [[unlikely]] {
      return Corrupt(where() + ": box " + UncheckedBoxString(c.box) +
                     " lies outside the global shape " + ShapeToString(t.global_shape));
    }
  }
  uint32_t file = previous_file_;
  if (!(flags & kSameFile)) {
    uint64_t delta = 0;
    if (!RawVarint(&delta)) [[unlikely]]
      return BadVarint("chunk file index");
    const int64_t f = static_cast<int64_t>(previous_file_) + UnZigZag(delta);
    if (f < 0 || static_cast<uint64_t>(f) >= m.files.size()) [[unlikely]] {
      return Corrupt(where() + ": file index " + std::to_string(f) + " out of range (" +
                     std::to_string(m.files.size()) + " files)");
    }
    file = static_cast<uint32_t>(f);
  }
  c.location.file_index = file;
  if (flags & kNextInFile) {
    c.location.offset = next_in_file_[file];
  } else if (!RawVarint(&c.location.offset)) [[unlikely]] {
    return BadVarint("chunk byte offset");
  }
  uint64_t elements = 0;
  CountElements(c.box.sizes.data(), rank, &elements);  // inside the shape: cannot overflow
  const uint64_t raw_bytes = elements * DTypeSize(t.dtype);
  if (c.encoding == ChunkEncoding::kRaw) {
    c.location.length = raw_bytes;
  } else {
    TESSERA_RETURN_IF_ERROR(Varint(&c.location.length, "chunk item length"));
    TESSERA_RETURN_IF_ERROR(Varint(&c.payload_offset, "chunk payload offset"));
    if (c.payload_offset > c.location.length || raw_bytes > c.location.length - c.payload_offset) {
      return Corrupt(where() + ": " + std::to_string(raw_bytes) + " bytes at payload offset " +
                     std::to_string(c.payload_offset) + " do not fit in its item of " +
                     std::to_string(c.location.length) + " bytes");
    }
  }
  const uint64_t file_size = m.files[file].size;
  if (c.location.length > file_size || c.location.offset > file_size - c.location.length)
      [[unlikely]] {
    return Location(m, c.location, where());
  }
  next_in_file_[file] = c.location.offset + c.location.length;
  if (flags & kHasOrder) TESSERA_RETURN_IF_ERROR(StorageOrder(c, rank, where()));
  if (m.checksum != ChecksumKind::kNone) {
    if (Remaining() < 8) [[unlikely]]
      return PastEnd("chunk checksum");
    c.location.checksum = LoadLE<uint64_t>(p_);
    p_ += 8;
    const uint64_t blocks = NumChecksumBlocks(raw_bytes, m.checksum_block_bytes);
    if (blocks > 1) {
      if ((blocks - 1) > Remaining() / 8) return PastEnd("chunk block checksums");
      c.block_checksums.resize(blocks - 1);
      std::memcpy(c.block_checksums.data(), p_, 8 * (blocks - 1));
      p_ += 8 * (blocks - 1);
    }
  }
  previous_sizes_ = &c.box.sizes;
  previous_file_ = file;
  return Status();
}

Status DecoderV2::StorageOrder(ChunkInfo& c, size_t rank, const std::string& where) {
  if (Remaining() < rank) return PastEnd("chunk storage order");
  c.storage_order.assign(p_, p_ + rank);
  p_ += rank;
  std::vector<bool> seen(rank, false);
  for (uint8_t d : c.storage_order) {
    if (d >= rank || seen[d]) {
      return Corrupt(where + ": storage order is not a permutation of the " + std::to_string(rank) +
                     " dimensions");
    }
    seen[d] = true;
  }
  return Status();
}

Status DecoderV2::Tensor(Metadata& m, TensorInfo& t, const std::string& previous_key, bool first) {
  TESSERA_RETURN_IF_ERROR(FrontCoded(&t.key, previous_key, first, "tensor key"));
  const std::string where = "tensor " + QuoteBytes(t.key);
  uint8_t dtype = 0, rank = 0, flags = 0;
  TESSERA_RETURN_IF_ERROR(U8(&dtype, "tensor dtype"));
  TESSERA_RETURN_IF_ERROR(U8(&rank, "tensor rank"));
  TESSERA_RETURN_IF_ERROR(U8(&flags, "tensor flags"));
  if (flags & ~kTensorPartial) {
    return Corrupt(where + ": unknown tensor flags " + std::to_string(flags));
  }
  t.partial = (flags & kTensorPartial) != 0;
  if (!IsValidDType(dtype)) {
    std::string what = where + ": unknown dtype value " + std::to_string(dtype);
    if (dtype == 0) return Corrupt(what);
    return Unimplemented(std::string(source_) + ": " + what +
                         " (written by a newer tessera? this build knows values 1.." +
                         std::to_string(static_cast<int>(kAllDTypes[std::size(kAllDTypes) - 1])) +
                         ")");
  }
  t.dtype = static_cast<DType>(dtype);
  if (rank > kMaxRank) {
    return Corrupt(where + ": rank " + std::to_string(rank) + " exceeds the limit of " +
                   std::to_string(kMaxRank));
  }
  t.global_shape.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    uint64_t dim = 0;
    TESSERA_RETURN_IF_ERROR(Varint(&dim, "tensor global shape"));
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Corrupt(where + ": global shape dimension " + std::to_string(dim) + " is too large");
    }
    t.global_shape[d] = static_cast<int64_t>(dim);
  }
  uint64_t elements = 0, bytes = 0;
  if (!CountElements(t.global_shape.data(), rank, &elements) ||
      __builtin_mul_overflow(elements, DTypeSize(t.dtype), &bytes) ||
      bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Corrupt(where + ": global shape " + ShapeToString(t.global_shape) + " is too large");
  }
  uint64_t count = 0;
  TESSERA_RETURN_IF_ERROR(Count(&count, 1 + rank, "chunk count"));
  t.chunks.resize(count);
  previous_offsets_.assign(rank, 0);
  previous_sizes_ = nullptr;
  previous_file_ = 0;
  uint64_t covered = 0;
  for (uint64_t i = 0; i < count; ++i) {
    TESSERA_RETURN_IF_ERROR(Chunk(m, t, i, where));
    uint64_t chunk_elements = 0;
    CountElements(t.chunks[i].box.sizes.data(), rank, &chunk_elements);
    covered += chunk_elements;  // each <= elements < 2^63: no overflow before the check
    if (covered > elements) break;
  }
  if (covered > elements || (covered < elements && !t.partial && m.part_rank < 0)) {
    return Corrupt(
        where + ": its " + std::to_string(count) + " chunks hold " +
        (covered > elements ? "more than " + std::to_string(elements) : std::to_string(covered)) +
        " elements, but the global shape " + ShapeToString(t.global_shape) + " has " +
        std::to_string(elements));
  }
  return Status();
}

Status DecoderV2::Objects(Metadata& m) {
  uint64_t count = 0;
  TESSERA_RETURN_IF_ERROR(Count(&count, 6, "object count"));
  m.objects.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    ObjectInfo& o = m.objects[i];
    TESSERA_RETURN_IF_ERROR(
        FrontCoded(&o.key, i ? m.objects[i - 1].key : std::string(), i == 0, "object key"));
    const std::string where = "object " + QuoteBytes(o.key);
    uint8_t encoding = 0;
    TESSERA_RETURN_IF_ERROR(U8(&encoding, "object encoding"));
    if (encoding > static_cast<uint8_t>(ObjectEncoding::kJson)) {
      return Corrupt(where + ": unknown object encoding " + std::to_string(encoding));
    }
    o.encoding = static_cast<ObjectEncoding>(encoding);
    uint64_t file = 0;
    TESSERA_RETURN_IF_ERROR(Varint(&file, "object file index"));
    if (file >= m.files.size()) {
      return Corrupt(where + ": file index " + std::to_string(file) + " out of range (" +
                     std::to_string(m.files.size()) + " files)");
    }
    o.location.file_index = static_cast<uint32_t>(file);
    TESSERA_RETURN_IF_ERROR(Varint(&o.location.offset, "object byte offset"));
    TESSERA_RETURN_IF_ERROR(Varint(&o.location.length, "object length"));
    TESSERA_RETURN_IF_ERROR(Location(m, o.location, where));
    if (m.checksum != ChecksumKind::kNone) {
      TESSERA_RETURN_IF_ERROR(U64(&o.location.checksum, "object checksum"));
    }
  }
  return Status();
}

Result<Metadata> DecoderV2::Decode() {
  Metadata m;
  m.format_version = version_;
  TESSERA_RETURN_IF_ERROR(Preamble(m));
  TESSERA_RETURN_IF_ERROR(Files(m));
  TESSERA_RETURN_IF_ERROR(Strings(m));
  uint64_t count = 0;
  TESSERA_RETURN_IF_ERROR(Count(&count, 5, "tensor count"));
  m.tensors.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    TESSERA_RETURN_IF_ERROR(
        Tensor(m, m.tensors[i], i ? m.tensors[i - 1].key : std::string(), i == 0));
  }
  TESSERA_RETURN_IF_ERROR(Objects(m));
  if (p_ != end_) {
    return Corrupt(std::to_string(Remaining()) + " unexpected bytes at the end of the body");
  }
  return m;
}

}  // namespace

Bytes EncodeBody(const Metadata& m, uint32_t version, CheckpointFormat format) {
  Bytes out;
  uint64_t chunks = 0;
  for (const TensorInfo& t : m.tensors) chunks += t.chunks.size();
  out.reserve(256 + chunks * 16 + m.files.size() * 24 + m.objects.size() * 32);
  Encoder e(&out);
  e.U8(static_cast<uint8_t>(format));
  e.U8(static_cast<uint8_t>(m.checksum));
  e.Varint(m.checksum_block_bytes);
  if (m.part_rank >= 0) {
    e.U8(kRankPart);
    e.Varint(static_cast<uint64_t>(m.part_rank));
  } else {
    e.U8(m.rank_local_reference && version >= 3 ? kReference : kWholeCheckpoint);
  }
  if (version >= 3) e.Varint(m.commit_seq);
  e.Str(m.save_id);
  e.Varint(static_cast<uint32_t>(m.num_ranks));
  e.Varint(static_cast<uint64_t>(std::max<int64_t>(m.save_time_unix_ms, 0)));
  e.Varint(m.files.size());
  for (size_t i = 0; i < m.files.size(); ++i) {
    e.FrontCoded(m.files[i].name, i ? m.files[i - 1].name : std::string_view());
    e.Varint(m.files[i].size);
  }
  e.Varint(m.separate_prefixes.size());
  for (const std::string& p : m.separate_prefixes) e.Str(p);
  e.Varint(m.user_metadata.size());
  for (const auto& [k, v] : m.user_metadata) {
    e.Str(k);
    e.Str(v);
  }
  FileCursor cursor(m.files.size());
  e.Varint(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorInfo& t = m.tensors[i];
    const size_t rank = std::min<size_t>(t.global_shape.size(), 255);
    e.FrontCoded(t.key, i ? m.tensors[i - 1].key : std::string_view());
    e.U8(static_cast<uint8_t>(t.dtype));
    e.U8(static_cast<uint8_t>(rank));
    e.U8(t.partial ? kTensorPartial : 0);
    for (size_t d = 0; d < rank; ++d) e.Varint(static_cast<uint64_t>(t.global_shape[d]));
    e.Varint(t.chunks.size());
    EncodeChunks(m, t, e, cursor);
  }
  e.Varint(m.objects.size());
  for (size_t i = 0; i < m.objects.size(); ++i) {
    const ObjectInfo& o = m.objects[i];
    e.FrontCoded(o.key, i ? m.objects[i - 1].key : std::string_view());
    e.U8(static_cast<uint8_t>(o.encoding));
    e.Varint(o.location.file_index);
    e.Varint(o.location.offset);
    e.Varint(o.location.length);
    if (m.checksum != ChecksumKind::kNone) e.U64(o.location.checksum);
  }
  return out;
}

Result<Metadata> DecodeBody(std::span<const uint8_t> body, std::string_view source,
                            uint32_t version) {
  return DecoderV2(body, source, version).Decode();
}

}  // namespace tessera::manifest_internal
