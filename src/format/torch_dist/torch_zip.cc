#include "format/torch_dist/torch_zip.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/crc32.h"
#include "format/torch_dist/pickle.h"
#include "format/torch_dist/pickle_writer.h"
#include "format/torch_dist/torch_dtype.h"

namespace tessera::torch_dist {
namespace {

// Zip record signatures and sizes (APPNOTE.TXT 4.3).
constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kCentralHeaderSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kZip64EndSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint32_t kDescriptorSig = 0x08074b50;
constexpr uint64_t kLocalHeaderSize = 30;
constexpr uint64_t kCentralHeaderSize = 46;
constexpr uint64_t kEndSize = 22;
constexpr uint64_t kZip64EndSize = 56;
constexpr uint64_t kZip64LocatorSize = 20;
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr uint64_t kU32Max = 0xFFFFFFFFu;
constexpr uint64_t kAlignment = 64;  // torch's kFieldAlignment

// Limits that keep a hostile item from making the reader allocate much: torch's archives have
// a few records and a data.pkl of a few hundred bytes per tensor.
constexpr uint64_t kMaxCentralDirectory = 64ull << 20;
constexpr uint64_t kMaxTensorPickle = 64ull << 20;

uint16_t Get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t Get32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t Get64(const uint8_t* p) { return Get32(p) | (static_cast<uint64_t>(Get32(p + 4)) << 32); }

std::string Num(uint64_t v) { return std::to_string(v); }

// The item's bytes as far as they have been read: cached ranges, read on demand.
class ItemBytes {
 public:
  ItemBytes(uint64_t length, const ItemReadFn& read, std::string_view source, ItemReadStats* stats)
      : length_(length), read_(read), source_(source), stats_(stats) {}

  uint64_t length() const { return length_; }
  const std::string& source() const { return source_; }

  Status Error(uint64_t offset, const std::string& what) const {
    return DataLoss(source_ + ": " + what + " at offset " + Num(offset) + " of the " +
                    Num(length_) + "-byte item");
  }

  // Reads the probe ranges (ItemProbeRanges) into the cache.
  Status Probe() {
    for (auto [offset, size] : ItemProbeRanges(length_)) {
      TESSERA_RETURN_IF_ERROR(Fetch(offset, size));
    }
    return Status();
  }

  // A view of [offset, offset + n), `what` naming it in errors. When not cached, reads at least
  // `at_least` bytes from `offset` (clipped to the item), so that what follows is cached too.
  Result<const uint8_t*> Get(uint64_t offset, uint64_t n, const std::string& what,
                             uint64_t at_least = 0) {
    if (offset > length_ || n > length_ - offset) {
      return Error(offset, what + " (" + Num(n) + " bytes) runs past the end of the item");
    }
    for (const Range& r : ranges_) {
      if (offset >= r.offset && offset + n <= r.offset + r.bytes.size()) {
        return r.bytes.data() + (offset - r.offset);
      }
    }
    TESSERA_RETURN_IF_ERROR(Fetch(offset, std::min(length_ - offset, std::max(n, at_least))));
    return ranges_.back().bytes.data();
  }

 private:
  struct Range {
    uint64_t offset;
    std::vector<uint8_t> bytes;
  };

  Status Fetch(uint64_t offset, uint64_t n) {
    Range r{offset, std::vector<uint8_t>(n)};
    if (n > 0) {
      Status s = read_(offset, r.bytes.data(), n);
      if (stats_) {
        ++stats_->reads;
        stats_->bytes += n;
      }
      if (!s.ok()) return s.WithContext(source_);
    }
    ranges_.push_back(std::move(r));
    return Status();
  }

  uint64_t length_;
  const ItemReadFn& read_;
  std::string source_;
  ItemReadStats* stats_;
  std::vector<Range> ranges_;  // each Range's buffer stays put when ranges_ grows
};

struct CentralDirectory {
  std::vector<ZipRecord> records;
  uint64_t offset = 0;  // where the central directory starts: records' data must end before
  std::string archive_name;

  const ZipRecord* Find(std::string_view name) const {
    for (const ZipRecord& r : records) {
      if (r.name == name) return &r;
    }
    return nullptr;
  }
};

// Finds the end of central directory record: the last "PK\5\6" whose comment reaches exactly
// to the end of the item.
Result<uint64_t> FindEnd(ItemBytes& item) {
  const uint64_t len = item.length();
  if (len < kEndSize) return item.Error(0, "no zip end record: the item is too short");
  // The comment is at most 65535 bytes: search the last kEndSize + 65535 bytes.
  const uint64_t span = std::min<uint64_t>(len, kEndSize + 0xFFFF);
  const uint64_t first = len - span;
  uint64_t window = std::min<uint64_t>(span, kItemProbeBytes);
  for (;;) {
    const uint64_t start = len - window;
    TESSERA_ASSIGN_OR_RETURN(const uint8_t* p, item.Get(start, window, "the zip end records"));
    for (uint64_t at = len - kEndSize + 1; at-- > start;) {
      const uint8_t* q = p + (at - start);
      if (Get32(q) == kEndSig && at + kEndSize + Get16(q + 20) == len) return at;
    }
    if (start == first) break;
    window = span;
  }
  return item.Error(len - kEndSize, "no zip end of central directory record (PK\\5\\6)");
}

// The zip64 extra field holds, in this order, the uncompressed size, the compressed size and the
// local header offset, each only when the central directory's field is 0xFFFFFFFF.
Status ParseZip64Extra(ItemBytes& item, uint64_t at, const uint8_t* extra, uint64_t extra_len,
                       const std::string& name, uint64_t* size, uint64_t* compressed,
                       uint64_t* offset) {
  for (uint64_t i = 0; i + 4 <= extra_len;) {
    const uint16_t id = Get16(extra + i), n = Get16(extra + i + 2);
    if (i + 4 + n > extra_len) break;
    if (id == kZip64ExtraId) {
      const uint8_t* f = extra + i + 4;
      uint64_t used = 0;
      for (uint64_t* field : {size, compressed, offset}) {
        if (*field != kU32Max) continue;
        if (used + 8 > n) return item.Error(at, "zip64 extra field of " + name + " is too short");
        *field = Get64(f + used);
        used += 8;
      }
      return Status();
    }
    i += 4 + n;
  }
  return item.Error(at, "record " + name + " needs a zip64 extra field and has none");
}

Result<CentralDirectory> ReadCentralDirectory(ItemBytes& item) {
  TESSERA_ASSIGN_OR_RETURN(uint64_t end_at, FindEnd(item));
  TESSERA_ASSIGN_OR_RETURN(const uint8_t* end, item.Get(end_at, kEndSize, "the zip end record"));
  uint64_t entries = Get16(end + 10);
  uint64_t cd_size = Get32(end + 12);
  uint64_t cd_offset = Get32(end + 16);
  uint64_t cd_limit = end_at;  // the central directory ends before the end records
  // ZIP64: a locator right before the end record points at the ZIP64 end record.
  if (end_at >= kZip64LocatorSize) {
    const uint64_t loc_at = end_at - kZip64LocatorSize;
    TESSERA_ASSIGN_OR_RETURN(const uint8_t* loc,
                             item.Get(loc_at, kZip64LocatorSize, "the zip64 end locator"));
    if (Get32(loc) == kZip64LocatorSig) {
      const uint64_t z_at = Get64(loc + 8);
      if (z_at > loc_at || loc_at - z_at < kZip64EndSize) {
        return item.Error(loc_at, "zip64 end locator points to offset " + Num(z_at) +
                                      ", not to a record before it");
      }
      TESSERA_ASSIGN_OR_RETURN(const uint8_t* z,
                               item.Get(z_at, kZip64EndSize, "the zip64 end record"));
      if (Get32(z) != kZip64EndSig) {
        return item.Error(z_at, "expected the zip64 end record (PK\\6\\6)");
      }
      entries = Get64(z + 32);
      cd_size = Get64(z + 40);
      cd_offset = Get64(z + 48);
      cd_limit = z_at;
    }
  }
  if (cd_offset > cd_limit || cd_size > cd_limit - cd_offset) {
    return item.Error(end_at, "central directory at " + Num(cd_offset) + " (" + Num(cd_size) +
                                  " bytes) overlaps the end records at " + Num(cd_limit));
  }
  if (cd_size > kMaxCentralDirectory) {
    return item.Error(cd_offset, "central directory of " + Num(cd_size) +
                                     " bytes is larger than this reader accepts");
  }
  if (entries > cd_size / kCentralHeaderSize) {
    return item.Error(end_at, Num(entries) + " records cannot fit in a central directory of " +
                                  Num(cd_size) + " bytes");
  }
  TESSERA_ASSIGN_OR_RETURN(const uint8_t* cd,
                           item.Get(cd_offset, cd_size, "the central directory"));

  CentralDirectory dir;
  dir.offset = cd_offset;
  dir.records.reserve(entries);
  uint64_t pos = 0;
  for (uint64_t e = 0; e < entries; ++e) {
    const uint64_t at = cd_offset + pos;
    if (cd_size - pos < kCentralHeaderSize || Get32(cd + pos) != kCentralHeaderSig) {
      return item.Error(at, "expected central directory header " + Num(e) + " (PK\\1\\2)");
    }
    const uint8_t* h = cd + pos;
    const uint16_t flags = Get16(h + 8), method = Get16(h + 10);
    const uint64_t name_len = Get16(h + 28), extra_len = Get16(h + 30), comment_len = Get16(h + 32);
    if (cd_size - pos - kCentralHeaderSize < name_len + extra_len + comment_len) {
      return item.Error(at, "central directory header " + Num(e) + " runs past the directory");
    }
    ZipRecord r;
    r.name.assign(reinterpret_cast<const char*>(h + kCentralHeaderSize), name_len);
    r.crc32 = Get32(h + 16);
    const uint64_t compressed = Get32(h + 20);
    r.size = Get32(h + 24);
    r.local_header_offset = Get32(h + 42);
    if (flags & 0x0001) return item.Error(at, "record " + r.name + " is encrypted");
    if (method != 0) {
      return item.Error(at, "record " + r.name + " uses compression method " + Num(method) +
                                "; only stored (0) records are supported");
    }
    uint64_t compressed_size = compressed;
    if (r.size == kU32Max || compressed == kU32Max || r.local_header_offset == kU32Max) {
      TESSERA_RETURN_IF_ERROR(ParseZip64Extra(item, at, h + kCentralHeaderSize + name_len,
                                              extra_len, r.name, &r.size, &compressed_size,
                                              &r.local_header_offset));
    }
    if (compressed_size != r.size) {
      return item.Error(at, "record " + r.name + " has compressed size " + Num(compressed_size) +
                                " and size " + Num(r.size) + "; only stored records are supported");
    }
    dir.records.push_back(std::move(r));
    pos += kCentralHeaderSize + name_len + extra_len + comment_len;
  }
  // torch names the archive by its first record's folder: "archive/data.pkl" -> "archive".
  if (dir.records.empty()) return item.Error(cd_offset, "the zip archive has no records");
  const size_t slash = dir.records[0].name.find('/');
  if (slash == std::string::npos) {
    return item.Error(cd_offset,
                      "first record '" + dir.records[0].name + "' is not inside an archive folder");
  }
  dir.archive_name = dir.records[0].name.substr(0, slash);
  return dir;
}

// The offset of a record's data: after its local header, whose name and extra field lengths
// may differ from the central directory's.
Result<uint64_t> RecordData(ItemBytes& item, const CentralDirectory& dir, const ZipRecord& r) {
  const uint64_t at = r.local_header_offset;
  TESSERA_ASSIGN_OR_RETURN(
      const uint8_t* h,
      item.Get(at, kLocalHeaderSize, "local header of " + r.name,
               kLocalHeaderSize + r.name.size() + 1024 + std::min<uint64_t>(r.size, 4096)));
  if (Get32(h) != kLocalHeaderSig) {
    return item.Error(at, "expected the local header of " + r.name + " (PK\\3\\4)");
  }
  const uint64_t name_len = Get16(h + 26), extra_len = Get16(h + 28);
  TESSERA_ASSIGN_OR_RETURN(const uint8_t* name,
                           item.Get(at + kLocalHeaderSize, name_len, "name of " + r.name));
  if (std::string_view(reinterpret_cast<const char*>(name), name_len) != r.name) {
    return item.Error(at, "local header names '" +
                              std::string(reinterpret_cast<const char*>(name), name_len) +
                              "', the central directory '" + r.name + "'");
  }
  const uint64_t data = at + kLocalHeaderSize + name_len + extra_len;
  if (data > dir.offset || r.size > dir.offset - data) {
    return item.Error(at, "data of " + r.name + " (" + Num(r.size) + " bytes from " + Num(data) +
                              ") overlaps the central directory at " + Num(dir.offset));
  }
  return data;
}

Result<std::vector<uint8_t>> ReadRecord(ItemBytes& item, const CentralDirectory& dir,
                                        const ZipRecord& r) {
  TESSERA_ASSIGN_OR_RETURN(uint64_t data, RecordData(item, dir, r));
  TESSERA_ASSIGN_OR_RETURN(const uint8_t* p, item.Get(data, r.size, r.name));
  std::vector<uint8_t> bytes(p, p + r.size);
  const uint32_t crc = Crc32(bytes.data(), bytes.size());
  if (crc != r.crc32) {
    return item.Error(
        data, r.name + " has CRC-32 " + Num(crc) + ", the central directory says " + Num(r.crc32));
  }
  return bytes;
}

// ---- data.pkl of a tensor ---------------------------------------------------------------------

struct PickledTensor {
  const TorchDType* dtype = nullptr;
  bool untyped_storage = false;
  std::string key;
  uint64_t storage_numel = 0;  // as pickled: elements (typed) or bytes (untyped)
  int64_t storage_offset = 0;
  std::vector<int64_t> size, stride;
  bool requires_grad = false;
  int version = 2;
};

Result<std::vector<int64_t>> NonNegativeInts(const PickleValue& v, std::string_view what) {
  if (!v.is(PickleKind::kTuple) && !v.is(PickleKind::kList)) {
    return InvalidArgument(std::string(what) + ": expected a tuple, found " + v.Describe());
  }
  std::vector<int64_t> out(v.size());
  for (size_t i = 0; i < out.size(); ++i) {
    Result<int64_t> x = v.item(i).AsInt();
    if (!x.ok() || *x < 0) {
      return InvalidArgument(std::string(what) + "[" + Num(i) + "]: expected an int >= 0, found " +
                             v.item(i).Describe());
    }
    out[i] = *x;
  }
  return out;
}

Result<PickledTensor> InterpretTensorPickle(const PickleValue& root) {
  PickleValue r = root;
  // nn.Parameter: _rebuild_parameter(tensor, requires_grad, backward_hooks).
  if (r.is(PickleKind::kReduce) && r.callable().IsGlobal("torch._utils", "_rebuild_parameter") &&
      r.args().size() >= 1) {
    r = r.args().item(0);
  }
  if (!r.is(PickleKind::kReduce)) {
    return InvalidArgument("data.pkl holds " + r.Describe() + ", not a tensor");
  }
  const PickleValue f = r.callable();
  const PickleValue a = r.args();
  PickledTensor t;
  if (f.IsGlobal("torch._utils", "_rebuild_tensor_v2") && a.size() >= 6) {
    t.version = 2;
  } else if (f.IsGlobal("torch._utils", "_rebuild_tensor_v3") && a.size() >= 7) {
    t.version = 3;
  } else {
    return InvalidArgument("data.pkl holds " + r.Describe() + " with " + Num(a.size()) +
                           " arguments, not torch._utils._rebuild_tensor_v2/_v3");
  }
  // The storage: persistent id ("storage", storage class, key, location, numel).
  const PickleValue storage = a.item(0);
  if (!storage.is(PickleKind::kPersId)) {
    return InvalidArgument("tensor storage is " + storage.Describe() + ", not a persistent id");
  }
  const PickleValue pid = storage.persistent_id();
  if (pid.size() != 5 || !pid.is(PickleKind::kTuple) ||
      pid.item(0).AsStr().value_or("") != "storage") {
    return InvalidArgument("storage persistent id is " + pid.Describe() +
                           ", not ('storage', type, key, location, numel)");
  }
  const PickleValue cls = pid.item(1);
  if (cls.IsGlobal("torch", "UntypedStorage") || cls.IsGlobal("torch.storage", "UntypedStorage")) {
    t.untyped_storage = true;
  } else if (cls.is(PickleKind::kGlobal) && cls.global_module() == "torch") {
    t.dtype = FindTorchDTypeByStorageClass(cls.global_name());
  }
  if (!t.untyped_storage && t.dtype == nullptr) {
    return InvalidArgument("unsupported storage type " + cls.Describe());
  }
  const PickleValue key = pid.item(2);
  if (key.is(PickleKind::kStr)) {
    t.key = std::string(*key.AsStr());
  } else if (key.is(PickleKind::kInt)) {
    t.key = Num(static_cast<uint64_t>(*key.AsInt()));
  } else {
    return InvalidArgument("storage key is " + key.Describe());
  }
  Result<int64_t> numel = pid.item(4).AsInt();
  if (!numel.ok() || *numel < 0) {
    return InvalidArgument("storage size is " + pid.item(4).Describe());
  }
  t.storage_numel = static_cast<uint64_t>(*numel);

  Result<int64_t> offset = a.item(1).AsInt();
  if (!offset.ok() || *offset < 0) {
    return InvalidArgument("storage offset is " + a.item(1).Describe());
  }
  t.storage_offset = *offset;
  TESSERA_ASSIGN_OR_RETURN(t.size, NonNegativeInts(a.item(2), "size"));
  TESSERA_ASSIGN_OR_RETURN(t.stride, NonNegativeInts(a.item(3), "stride"));
  if (t.size.size() != t.stride.size()) {
    return InvalidArgument("size has " + Num(t.size.size()) + " dimensions, stride " +
                           Num(t.stride.size()));
  }
  Result<bool> rg = a.item(4).AsBool();
  if (!rg.ok()) return InvalidArgument("requires_grad is " + a.item(4).Describe());
  t.requires_grad = *rg;
  if (t.version == 3) {
    const PickleValue d = a.item(6);
    const TorchDType* td = d.is(PickleKind::kGlobal) && d.global_module() == "torch"
                               ? FindTorchDType(d.global_name())
                               : nullptr;
    if (td == nullptr) return InvalidArgument("unsupported dtype " + d.Describe());
    if (t.dtype != nullptr && t.dtype != td) {
      return InvalidArgument("storage type " + cls.Describe() + " disagrees with dtype " +
                             d.Describe());
    }
    t.dtype = td;
  } else if (t.untyped_storage) {
    return InvalidArgument("_rebuild_tensor_v2 over an untyped storage has no dtype");
  }
  return t;
}

// Multiplies, failing on overflow of `limit`.
bool MulLimit(uint64_t a, uint64_t b, uint64_t limit, uint64_t* out) {
  if (a != 0 && b > limit / a) return false;
  *out = a * b;
  return true;
}

Result<TorchTensorItem> ReadTensor(ItemBytes& item) {
  TESSERA_ASSIGN_OR_RETURN(CentralDirectory dir, ReadCentralDirectory(item));
  const std::string pkl_name = dir.archive_name + "/data.pkl";
  const ZipRecord* pkl = dir.Find(pkl_name);
  if (pkl == nullptr) return item.Error(dir.offset, "the archive has no " + pkl_name);
  if (pkl->size > kMaxTensorPickle) {
    return item.Error(pkl->local_header_offset,
                      pkl_name + " of " + Num(pkl->size) + " bytes is too large for a tensor");
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<uint8_t> pkl_bytes, ReadRecord(item, dir, *pkl));
  TESSERA_ASSIGN_OR_RETURN(PickleTree tree,
                           ParsePickle(pkl_bytes, item.source() + ": " + pkl_name));
  Result<PickledTensor> pt = InterpretTensorPickle(tree.root());
  if (!pt.ok()) return DataLoss(item.source() + ": " + pkl_name + ": " + pt.status().message());

  TorchTensorItem t;
  t.torch_dtype = std::string(pt->dtype->name);
  t.element_size = pt->dtype->element_size;
  t.size = std::move(pt->size);
  t.stride = std::move(pt->stride);
  t.storage_offset = pt->storage_offset;
  t.requires_grad = pt->requires_grad;
  t.rebuild_version = pt->version;
  t.archive_name = dir.archive_name;
  t.storage_key = pt->key;

  const std::string data_name = dir.archive_name + "/data/" + pt->key;
  const ZipRecord* rec = dir.Find(data_name);
  if (rec == nullptr) return item.Error(dir.offset, "the archive has no " + data_name);
  TESSERA_ASSIGN_OR_RETURN(t.data_offset, RecordData(item, dir, *rec));
  t.data_size = rec->size;
  t.data_crc32 = rec->crc32;

  // The record holds the whole storage; the tensor must lie inside it.
  uint64_t storage_bytes = pt->storage_numel;
  if (!pt->untyped_storage &&
      !MulLimit(pt->storage_numel, t.element_size, UINT64_MAX, &storage_bytes)) {
    storage_bytes = UINT64_MAX;
  }
  if (storage_bytes != rec->size || rec->size % t.element_size != 0) {
    return item.Error(t.data_offset, data_name + " holds " + Num(rec->size) +
                                         " bytes; the storage needs " + Num(pt->storage_numel) +
                                         " x " + (pt->untyped_storage ? "1" : Num(t.element_size)) +
                                         " bytes of " + t.torch_dtype);
  }
  t.storage_elements = rec->size / t.element_size;
  bool empty = false;
  uint64_t last = static_cast<uint64_t>(t.storage_offset);  // largest element index used
  for (size_t d = 0; d < t.size.size(); ++d) {
    if (t.size[d] == 0) empty = true;
  }
  bool fits = true;
  for (size_t d = 0; d < t.size.size() && !empty; ++d) {
    uint64_t step = 0;
    fits = fits && MulLimit(static_cast<uint64_t>(t.size[d] - 1),
                            static_cast<uint64_t>(t.stride[d]), UINT64_MAX / 2, &step);
    last += step;
    fits = fits && last < UINT64_MAX / 2;
  }
  if (!empty && (!fits || last >= t.storage_elements)) {
    return item.Error(t.data_offset, "tensor of size and stride in " + pkl_name +
                                         " reaches past its storage of " + Num(t.storage_elements) +
                                         " elements");
  }
  return t;
}

Result<TorchObjectItem> ReadObject(ItemBytes& item) {
  TorchObjectItem o;
  TESSERA_ASSIGN_OR_RETURN(const uint8_t* head, item.Get(0, std::min<uint64_t>(item.length(), 4),
                                                         "the item's first bytes"));
  o.is_zip = item.length() >= 4 && Get32(head) == kLocalHeaderSig;
  if (!o.is_zip) {
    TESSERA_ASSIGN_OR_RETURN(const uint8_t* all, item.Get(0, item.length(), "the item"));
    o.data.assign(all, all + item.length());
    return o;
  }
  TESSERA_ASSIGN_OR_RETURN(CentralDirectory dir, ReadCentralDirectory(item));
  const std::string pkl_name = dir.archive_name + "/data.pkl";
  const ZipRecord* pkl = dir.Find(pkl_name);
  if (pkl == nullptr) return item.Error(dir.offset, "the archive has no " + pkl_name);
  TESSERA_ASSIGN_OR_RETURN(o.data, ReadRecord(item, dir, *pkl));
  o.archive_name = std::move(dir.archive_name);
  o.records = std::move(dir.records);
  return o;
}

ItemReadFn MemoryReader(std::span<const uint8_t> item) {
  return [item](uint64_t offset, void* dst, size_t n) {
    // ItemBytes checks every range against the item's length before reading.
    std::memcpy(dst, item.data() + offset, n);
    return Status();
  };
}

// ---- writing ----------------------------------------------------------------------------------

void Put16(std::vector<uint8_t>& b, uint64_t v) {
  b.push_back(static_cast<uint8_t>(v));
  b.push_back(static_cast<uint8_t>(v >> 8));
}
void Put32(std::vector<uint8_t>& b, uint64_t v) {
  Put16(b, v & 0xFFFF);
  Put16(b, (v >> 16) & 0xFFFF);
}
void Put64(std::vector<uint8_t>& b, uint64_t v) {
  Put32(b, v & 0xFFFFFFFFu);
  Put32(b, v >> 32);
}

// Where miniz (as PyTorchStreamWriter drives it) puts one record.
struct RecordLayout {
  bool zip64_size = false;    // size >= 0xFFFFFFFF: sizes go to zip64 extra fields
  bool zip64_offset = false;  // local header at or beyond 0xFFFFFFFF
  uint64_t padding = 0;       // 'Z' bytes in the FB extra field
  uint64_t data_offset = 0;
  uint64_t descriptor_size = 0;  // 0 for an empty record (no data descriptor)
  uint64_t end = 0;              // first byte after the record
};

RecordLayout LayOutRecord(const ZipRecord& r) {
  RecordLayout l;
  l.zip64_size = r.size >= kU32Max;
  l.zip64_offset = r.local_header_offset >= kU32Max;
  // torch's getPadding: the data starts after the header, the name, the zip64 extra field if
  // any, and the FB field's 4-byte header; the FB field pads that to 64.
  uint64_t start = r.local_header_offset + kLocalHeaderSize + r.name.size() + 4;
  if (l.zip64_size || l.zip64_offset)
    start += 4 + (l.zip64_size ? 16 : 0) + (l.zip64_offset ? 8 : 0);
  l.padding = (kAlignment - start % kAlignment) % kAlignment;
  l.data_offset = start + l.padding;
  l.descriptor_size = r.size == 0 ? 0 : (l.zip64_size || l.zip64_offset ? 24 : 16);
  l.end = l.data_offset + r.size + l.descriptor_size;
  return l;
}

void LocalHeader(std::vector<uint8_t>& b, const ZipRecord& r, const RecordLayout& l) {
  const bool zip64 = l.zip64_size || l.zip64_offset;
  const uint64_t zip64_len = zip64 ? 4 + (l.zip64_size ? 16 : 0) + (l.zip64_offset ? 8 : 0) : 0;
  Put32(b, kLocalHeaderSig);
  Put16(b, 0);                         // version needed
  Put16(b, r.size ? 0x0808 : 0x0800);  // UTF-8 names; data descriptor follows the data
  Put16(b, 0);                         // stored
  Put32(b, 0);                         // time, date
  Put32(b, 0);                         // CRC-32: in the descriptor
  Put64(b, 0);                         // sizes: in the descriptor
  Put16(b, r.name.size());
  Put16(b, zip64_len + 4 + l.padding);
  b.insert(b.end(), r.name.begin(), r.name.end());
  if (zip64) {
    Put16(b, kZip64ExtraId);
    Put16(b, zip64_len - 4);
    if (l.zip64_size) {
      Put64(b, r.size);
      Put64(b, 0);  // miniz writes the compressed size before it knows it
    }
    if (l.zip64_offset) Put64(b, r.local_header_offset);
  }
  b.push_back('F');
  b.push_back('B');
  Put16(b, l.padding);
  b.insert(b.end(), l.padding, 'Z');
}

void Descriptor(std::vector<uint8_t>& b, const ZipRecord& r, const RecordLayout& l) {
  if (l.descriptor_size == 0) return;
  Put32(b, kDescriptorSig);
  Put32(b, r.crc32);
  if (l.descriptor_size == 24) {
    Put64(b, r.size);
    Put64(b, r.size);
  } else {
    Put32(b, r.size);
    Put32(b, r.size);
  }
}

void CentralHeader(std::vector<uint8_t>& b, const ZipRecord& r, const RecordLayout& l) {
  const bool zip64 = l.zip64_size || l.zip64_offset;
  const uint64_t zip64_len = zip64 ? 4 + (l.zip64_size ? 16 : 0) + (l.zip64_offset ? 8 : 0) : 0;
  Put32(b, kCentralHeaderSig);
  Put16(b, 0);  // version made by
  Put16(b, 0);  // version needed
  Put16(b, r.size ? 0x0808 : 0x0800);
  Put16(b, 0);  // stored
  Put32(b, 0);  // time, date
  Put32(b, r.crc32);
  Put32(b, std::min(r.size, kU32Max));
  Put32(b, std::min(r.size, kU32Max));
  Put16(b, r.name.size());
  Put16(b, zip64_len);
  Put16(b, 0);  // comment
  Put16(b, 0);  // disk
  Put16(b, 0);  // internal attributes
  Put32(b, 0);  // external attributes
  Put32(b, std::min(r.local_header_offset, kU32Max));
  b.insert(b.end(), r.name.begin(), r.name.end());
  if (zip64) {
    Put16(b, kZip64ExtraId);
    Put16(b, zip64_len - 4);
    if (l.zip64_size) {
      Put64(b, r.size);
      Put64(b, r.size);
    }
    if (l.zip64_offset) Put64(b, r.local_header_offset);
  }
}

uint64_t CentralHeaderSize(const ZipRecord& r, const RecordLayout& l) {
  const bool zip64 = l.zip64_size || l.zip64_offset;
  return kCentralHeaderSize + r.name.size() +
         (zip64 ? 4 + (l.zip64_size ? 16 : 0) + (l.zip64_offset ? 8 : 0) : 0);
}

// Sets each record's local_header_offset; returns where the central directory starts.
uint64_t Place(std::vector<ZipRecord>& records) {
  uint64_t cursor = 0;
  for (ZipRecord& r : records) {
    r.local_header_offset = cursor;
    cursor = LayOutRecord(r).end;
  }
  return cursor;
}

// Central directory, ZIP64 end record and locator, end record (as miniz's finalize with
// MZ_ZIP_FLAG_WRITE_ZIP64, which torch sets).
void EndOfArchive(std::vector<uint8_t>& b, const std::vector<ZipRecord>& records,
                  uint64_t cd_offset) {
  uint64_t cd_size = 0;
  for (const ZipRecord& r : records) {
    const RecordLayout l = LayOutRecord(r);
    cd_size += CentralHeaderSize(r, l);
    CentralHeader(b, r, l);
  }
  const uint64_t zip64_end = cd_offset + cd_size;
  Put32(b, kZip64EndSig);
  Put64(b, kZip64EndSize - 12);
  Put16(b, 0x031E);  // made by: Unix, 3.0
  Put16(b, 0x002D);  // needed: 4.5 (zip64)
  Put32(b, 0);
  Put32(b, 0);
  Put64(b, records.size());
  Put64(b, records.size());
  Put64(b, cd_size);
  Put64(b, cd_offset);
  Put32(b, kZip64LocatorSig);
  Put32(b, 0);
  Put64(b, zip64_end);
  Put32(b, 1);
  Put32(b, kEndSig);
  Put16(b, 0);
  Put16(b, 0);
  Put16(b, std::min<uint64_t>(records.size(), 0xFFFF));
  Put16(b, std::min<uint64_t>(records.size(), 0xFFFF));
  Put32(b, std::min(cd_size, kU32Max));
  Put32(b, std::min(cd_offset, kU32Max));
  Put16(b, 0);  // comment
}

uint64_t EndOfArchiveSize(const std::vector<ZipRecord>& records) {
  uint64_t size = kZip64EndSize + kZip64LocatorSize + kEndSize;
  for (const ZipRecord& r : records) size += CentralHeaderSize(r, LayOutRecord(r));
  return size;
}

constexpr std::string_view kVersionRecord = "3\n";  // torch 1.13's file format version
constexpr std::string_view kArchive = "archive";

ZipRecord Record(std::string name, std::span<const uint8_t> data) {
  ZipRecord r;
  r.name = std::move(name);
  r.size = data.size();
  r.crc32 = Crc32(data.data(), data.size());
  return r;
}

std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// data.pkl of a tensor, byte for byte as torch.save's protocol 2 pickler (memo indices 0, 1,
// ... in the order CPython assigns them).
std::vector<uint8_t> TensorPickle(const TorchDType& dtype, const std::vector<int64_t>& size,
                                  uint64_t numel, bool requires_grad) {
  const bool v3 = dtype.storage_class.empty();
  PickleWriter w(2);
  w.Global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  w.Memoize();
  w.Mark();
  w.Mark();
  w.Str("storage");
  w.Memoize();
  // torch 2.x's own class path: torch.load(weights_only=True), which DCP's reader uses since
  // torch 2.6, allows torch.storage.UntypedStorage and refuses the alias torch.UntypedStorage.
  w.Global(v3 ? "torch.storage" : "torch", v3 ? "UntypedStorage" : dtype.storage_class);
  w.Memoize();
  w.Str("0");
  w.Memoize();
  w.Str("cpu");
  w.Memoize();
  w.Int(static_cast<int64_t>(v3 ? numel * dtype.element_size : numel));
  w.Tuple();
  w.Memoize();
  w.BinPersId();
  w.Int(0);  // storage offset
  std::vector<int64_t> stride(size.size());
  int64_t s = 1;
  for (size_t d = size.size(); d-- > 0;) {
    stride[d] = s;
    s *= std::max<int64_t>(size[d], 1);
  }
  for (const std::vector<int64_t>* t : {&size, static_cast<const std::vector<int64_t>*>(&stride)}) {
    w.IntTuple(*t);
    if (!t->empty()) w.Memoize();
  }
  w.Bool(requires_grad);
  w.Global("collections", "OrderedDict");
  w.Memoize();
  w.EmptyTuple();
  w.Reduce();
  w.Memoize();
  if (v3) {
    w.Global("torch", dtype.name);
    w.Memoize();
  }
  w.Tuple();
  w.Memoize();
  w.Reduce();
  w.Memoize();
  w.Stop();
  return w.Take();
}

std::string ShapeText(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + ")";
}

}  // namespace

// ---- public: reading --------------------------------------------------------------------------

std::vector<std::pair<uint64_t, uint64_t>> ItemProbeRanges(uint64_t item_length) {
  if (item_length <= 2 * kItemProbeBytes) return {{0, item_length}};
  return {{0, kItemProbeBytes}, {item_length - kItemProbeBytes, kItemProbeBytes}};
}

int64_t TorchTensorItem::numel() const {
  int64_t n = 1;
  for (int64_t d : size) n *= d;
  return n;
}

bool TorchTensorItem::IsContiguous() const {
  int64_t expected = 1;
  for (size_t d = size.size(); d-- > 0;) {
    if (size[d] == 0) return true;
    if (size[d] != 1 && stride[d] != expected) return false;
    expected *= size[d];
  }
  return true;
}

Result<std::pair<uint64_t, uint64_t>> TorchTensorItem::ContiguousRange() const {
  if (!IsContiguous()) {
    return FailedPrecondition("tensor of size " + ShapeText(size) + " and stride " +
                              ShapeText(stride) + " is not row-major contiguous");
  }
  const uint64_t n = static_cast<uint64_t>(numel());
  if (n == 0) return std::make_pair(data_offset, uint64_t{0});
  return std::make_pair(data_offset + static_cast<uint64_t>(storage_offset) * element_size,
                        n * element_size);
}

Result<std::vector<int>> TorchTensorItem::StorageOrder() const {
  std::vector<int> order(size.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = static_cast<int>(d);
  if (IsContiguous()) return order;
  // Outermost first: larger strides first; dimensions of size 1 may have any stride.
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return stride[a] > stride[b]; });
  int64_t expected = 1;
  for (size_t i = order.size(); i-- > 0;) {
    const int d = order[i];
    if (size[d] != 1 && stride[d] != expected) {
      return FailedPrecondition("tensor of size " + ShapeText(size) + " and stride " +
                                ShapeText(stride) +
                                " is not a permutation of a row-major block of its storage");
    }
    expected *= size[d];
  }
  return order;
}

Result<TorchTensorItem> ReadTorchTensorItem(uint64_t item_length, const ItemReadFn& read,
                                            std::string_view source, ItemReadStats* stats) {
  ItemBytes item(item_length, read, source, stats);
  TESSERA_RETURN_IF_ERROR(item.Probe());
  return ReadTensor(item);
}

Result<TorchTensorItem> ParseTorchTensorItem(std::span<const uint8_t> bytes,
                                             std::string_view source) {
  const ItemReadFn read = MemoryReader(bytes);
  return ReadTorchTensorItem(bytes.size(), read, source);
}

Result<TorchObjectItem> ReadTorchObjectItem(uint64_t item_length, const ItemReadFn& read,
                                            std::string_view source, ItemReadStats* stats) {
  ItemBytes item(item_length, read, source, stats);
  TESSERA_RETURN_IF_ERROR(item.Probe());
  return ReadObject(item);
}

Result<TorchObjectItem> ParseTorchObjectItem(std::span<const uint8_t> bytes,
                                             std::string_view source) {
  const ItemReadFn read = MemoryReader(bytes);
  return ReadTorchObjectItem(bytes.size(), read, source);
}

namespace {
Result<ItemReadFn> FileReader(const ReadableFile& file, uint64_t item_offset,
                              uint64_t item_length) {
  if (item_offset > file.size() || item_length > file.size() - item_offset) {
    return DataLoss(file.path() + ": item at " + Num(item_offset) + " of " + Num(item_length) +
                    " bytes runs past the end of the " + Num(file.size()) + "-byte file");
  }
  return ItemReadFn([&file, item_offset](uint64_t offset, void* dst, size_t n) {
    return file.ReadAt(item_offset + offset, dst, n);
  });
}
}  // namespace

Result<TorchTensorItem> ReadTorchTensorItem(const ReadableFile& file, uint64_t item_offset,
                                            uint64_t item_length, ItemReadStats* stats) {
  TESSERA_ASSIGN_OR_RETURN(ItemReadFn read, FileReader(file, item_offset, item_length));
  return ReadTorchTensorItem(item_length, read, file.path() + " item at " + Num(item_offset),
                             stats);
}

Result<TorchObjectItem> ReadTorchObjectItem(const ReadableFile& file, uint64_t item_offset,
                                            uint64_t item_length, ItemReadStats* stats) {
  TESSERA_ASSIGN_OR_RETURN(ItemReadFn read, FileReader(file, item_offset, item_length));
  return ReadTorchObjectItem(item_length, read, file.path() + " item at " + Num(item_offset),
                             stats);
}

namespace {
Status CheckRecords(uint64_t item_length, const ItemReadFn& read, std::string_view source,
                    ItemReadStats* stats, uint64_t* bytes_checked) {
  ItemBytes item(item_length, read, source, stats);
  TESSERA_RETURN_IF_ERROR(item.Probe());
  TESSERA_ASSIGN_OR_RETURN(const uint8_t* head, item.Get(0, std::min<uint64_t>(item_length, 4),
                                                         "the item's first bytes"));
  if (item_length < 4 || Get32(head) != kLocalHeaderSig) return Status();  // raw bytes
  TESSERA_ASSIGN_OR_RETURN(CentralDirectory dir, ReadCentralDirectory(item));
  constexpr uint64_t kPiece = 1u << 20;
  std::vector<uint8_t> buffer;
  for (const ZipRecord& r : dir.records) {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t data, RecordData(item, dir, r));
    Crc32Stream crc;
    for (uint64_t done = 0; done < r.size;) {
      const uint64_t n = std::min(kPiece, r.size - done);
      buffer.resize(n);
      TESSERA_RETURN_IF_ERROR(read(data + done, buffer.data(), n).WithContext(item.source()));
      if (stats) ++stats->reads, stats->bytes += n;
      crc.Update(buffer.data(), n);
      done += n;
    }
    if (crc.value() != r.crc32) {
      return item.Error(data, r.name + " has CRC-32 " + Num(crc.value()) +
                                  ", the central directory says " + Num(r.crc32));
    }
    if (bytes_checked) *bytes_checked += r.size;
  }
  return Status();
}
}  // namespace

Status CheckTorchItemRecords(const ReadableFile& file, uint64_t item_offset, uint64_t item_length,
                             ItemReadStats* stats, uint64_t* bytes_checked) {
  TESSERA_ASSIGN_OR_RETURN(ItemReadFn read, FileReader(file, item_offset, item_length));
  return CheckRecords(item_length, read, file.path() + " item at " + Num(item_offset), stats,
                      bytes_checked);
}

Status CheckTorchItemRecords(std::span<const uint8_t> item, std::string_view source,
                             uint64_t* bytes_checked) {
  const ItemReadFn read = MemoryReader(item);
  return CheckRecords(item.size(), read, source, nullptr, bytes_checked);
}

// ---- public: writing --------------------------------------------------------------------------

Result<TorchItemLayout> LayOutTorchTensorItem(const TorchTensorSpec& spec) {
  const TorchDType* dtype = FindTorchDType(spec.torch_dtype);
  if (dtype == nullptr) {
    return InvalidArgument("unknown torch dtype '" + spec.torch_dtype + "'");
  }
  uint64_t numel = 1;
  for (int64_t d : spec.size) {
    if (d < 0 || !MulLimit(numel, static_cast<uint64_t>(d), (uint64_t{1} << 62) / 16, &numel)) {
      return InvalidArgument("tensor size has a negative or too large dimension");
    }
  }
  TorchItemLayout layout;
  layout.archive_name = std::string(kArchive);
  const std::vector<uint8_t> pkl = TensorPickle(*dtype, spec.size, numel, spec.requires_grad);
  ZipRecord data;
  data.name = layout.archive_name + "/data/0";
  data.size = numel * dtype->element_size;
  layout.records = {Record(layout.archive_name + "/data.pkl", pkl), data,
                    Record(layout.archive_name + "/version", AsBytes(kVersionRecord))};
  const uint64_t cd_offset = Place(layout.records);

  const RecordLayout pkl_layout = LayOutRecord(layout.records[0]);
  const RecordLayout data_layout = LayOutRecord(layout.records[1]);
  std::vector<uint8_t>& b = layout.prefix;
  LocalHeader(b, layout.records[0], pkl_layout);
  b.insert(b.end(), pkl.begin(), pkl.end());
  Descriptor(b, layout.records[0], pkl_layout);
  LocalHeader(b, layout.records[1], data_layout);
  layout.data_offset = b.size();
  layout.data_size = data.size;
  layout.suffix_size = data_layout.descriptor_size +
                       (cd_offset - layout.records[2].local_header_offset) +
                       EndOfArchiveSize(layout.records);
  layout.total_size = cd_offset + EndOfArchiveSize(layout.records);
  return layout;
}

std::vector<uint8_t> TorchItemSuffix(const TorchItemLayout& layout, uint32_t data_crc32) {
  std::vector<ZipRecord> records = layout.records;
  records[1].crc32 = data_crc32;
  std::vector<uint8_t> b;
  b.reserve(layout.suffix_size);
  Descriptor(b, records[1], LayOutRecord(records[1]));
  const RecordLayout version = LayOutRecord(records[2]);
  LocalHeader(b, records[2], version);
  b.insert(b.end(), kVersionRecord.begin(), kVersionRecord.end());
  Descriptor(b, records[2], version);
  EndOfArchive(b, records, version.end);
  return b;
}

Result<std::vector<uint8_t>> MakeTorchTensorItem(const TorchTensorSpec& spec,
                                                 std::span<const uint8_t> data) {
  TESSERA_ASSIGN_OR_RETURN(TorchItemLayout layout, LayOutTorchTensorItem(spec));
  if (data.size() != layout.data_size) {
    return InvalidArgument("tensor data has " + Num(data.size()) + " bytes, the tensor " +
                           Num(layout.data_size));
  }
  std::vector<uint8_t> item = std::move(layout.prefix);
  item.insert(item.end(), data.begin(), data.end());
  const std::vector<uint8_t> suffix = TorchItemSuffix(layout, Crc32(data.data(), data.size()));
  item.insert(item.end(), suffix.begin(), suffix.end());
  return item;
}

std::vector<uint8_t> MakeTorchObjectItem(std::span<const uint8_t> data_pkl) {
  std::vector<ZipRecord> records = {
      Record(std::string(kArchive) + "/data.pkl", data_pkl),
      Record(std::string(kArchive) + "/version", AsBytes(kVersionRecord))};
  const uint64_t cd_offset = Place(records);
  std::vector<uint8_t> b;
  b.reserve(cd_offset + EndOfArchiveSize(records));
  for (size_t i = 0; i < records.size(); ++i) {
    const RecordLayout l = LayOutRecord(records[i]);
    LocalHeader(b, records[i], l);
    const std::span<const uint8_t> data = i == 0 ? data_pkl : AsBytes(kVersionRecord);
    b.insert(b.end(), data.begin(), data.end());
    Descriptor(b, records[i], l);
  }
  EndOfArchive(b, records, cd_offset);
  return b;
}

std::vector<uint8_t> PickleBytesObject(std::span<const uint8_t> raw) {
  PickleWriter w(2);
  if (raw.empty()) {
    w.Global("__builtin__", "bytes");
    w.Memoize();
    w.EmptyTuple();
  } else {
    // bytes -> str by latin-1 (each byte one code point), stored as UTF-8.
    std::string text;
    text.reserve(raw.size() * 2);
    for (uint8_t c : raw) {
      if (c < 0x80) {
        text.push_back(static_cast<char>(c));
      } else {
        text.push_back(static_cast<char>(0xC0 | (c >> 6)));
        text.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      }
    }
    w.Global("_codecs", "encode");
    w.Memoize();
    w.Str(text);
    w.Memoize();
    w.Str("latin1");
    w.Memoize();
    w.Tuple2();
    w.Memoize();
  }
  w.Reduce();
  w.Memoize();
  w.Stop();
  return w.Take();
}

std::vector<uint8_t> MakeTorchBytesItem(std::span<const uint8_t> raw) {
  return MakeTorchObjectItem(PickleBytesObject(raw));
}

}  // namespace tessera::torch_dist
