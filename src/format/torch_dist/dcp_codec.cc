#include "format/torch_dist/dcp_codec.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "format/bounded_json.h"
#include "format/tessera/manifest_internal.h"
#include "format/torch_dist/dcp_writer.h"
#include "format/torch_dist/torch_dtype.h"

namespace tessera::torch_dist {
namespace {

std::string Num(uint64_t v) { return std::to_string(v); }

std::string ShapeText(std::span<const int64_t> v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + ")";
}

// Adds data file `name` to `m` once; returns its index. The file must be in `sizes`.
class FileTable {
 public:
  FileTable(Metadata& m, const std::map<std::string, uint64_t>& sizes, const std::string& source)
      : m_(m), sizes_(sizes), source_(source) {}

  Result<uint32_t> Index(const std::string& name) {
    // Consecutive items are usually in one file: the last answer first.
    if (last_ != nullptr && *last_ == name) return last_index_;
    auto it = index_.find(name);
    if (it == index_.end()) {
      auto size = sizes_.find(name);
      if (size == sizes_.end()) {
        return DataLoss(source_ + " names data file '" + name + "', which is missing");
      }
      it = index_.emplace(name, static_cast<uint32_t>(m_.files.size())).first;
      m_.files.push_back(FileInfo{name, size->second});
    }
    last_ = &it->first;
    last_index_ = it->second;
    return it->second;
  }

 private:
  const std::string* last_ = nullptr;  // a key of index_ (stable: std::map)
  uint32_t last_index_ = 0;
  Metadata& m_;
  const std::map<std::string, uint64_t>& sizes_;
  const std::string& source_;
  std::map<std::string, uint32_t> index_;
};

// The memory of the Metadata being built, counted against DcpExpansionBudget (dcp_metadata.h):
// DcpMetadata is bounded by the size of the .metadata already, but an N-D reformulated chunk
// becomes up to 2N-1 boxes of N dimensions each here.
class MetadataBudget {
 public:
  MetadataBudget(const std::string& source, uint64_t metadata_bytes)
      : source_(source),
        metadata_bytes_(metadata_bytes),
        limit_(DcpExpansionBudget(metadata_bytes)) {}

  // Charges a chunk of `rank` dimensions of `key`.
  Status Chunk(const std::string& key, size_t rank) {
    used_ += sizeof(ChunkInfo) + 16 * rank;
    if (used_ <= limit_) [[likely]]
      return Status::Ok();
    return DataLoss(source_ + ": key '" + key + "': the index this .metadata describes takes " +
                    "more than " + std::to_string(limit_) + " bytes of memory (" +
                    std::to_string(kDcpExpansionFactor) + " times its " +
                    std::to_string(metadata_bytes_) + " bytes, plus " +
                    std::to_string(kDcpExpansionFloor >> 20) + " MiB)");
  }

 private:
  const std::string& source_;
  const uint64_t metadata_bytes_;
  const uint64_t limit_;
  uint64_t used_ = 0;
};

// The location of storage entry `s` (a whole item), checked against its file. `what()` names
// the item's owner in errors (built only then: a .metadata may hold millions of items).
template <typename What>
Result<ByteLocation> ItemLocation(const DcpStorage& s, FileTable& files, const Metadata& m,
                                  const What& what, const std::string& source) {
  TESSERA_ASSIGN_OR_RETURN(const uint32_t file, files.Index(s.relative_path));
  const uint64_t size = m.files[file].size;
  if (s.length > size || s.offset_in_file > size - s.length) [[unlikely]] {
    return DataLoss(source + ": the item of " + what() + " at offset " + Num(s.offset_in_file) +
                    " (" + Num(s.length) + " bytes) lies outside data file '" + s.relative_path +
                    "' (" + Num(size) + " bytes; truncated?)");
  }
  return ByteLocation{file, s.offset_in_file, s.length, 0};
}

// ---- Megatron-Core's N-D reformulated flattened tensors ---------------------------------------
//
// A distributed optimizer's state of a tensor of global shape G, split into a grid of
// fragments (axis_fragmentations F, each fragment of shape L = G / F), is saved as the DCP
// tensor F + (prod(L),): fragment f's elements, flattened row-major, along the last axis; each
// chunk (1, ..., 1, len) at (f, start) is a flat range [start, start + len) of fragment f.
// tessera exposes the original tensor: each such chunk becomes the boxes of G that flat range
// covers (at most 2N-1, each contiguous in the item), payload_offset bytes into the item.

// Calls emit(local offsets, sizes, flat begin) for the boxes that cover the flat range [b, e)
// of a row-major block of shape `sizes` (local coordinates), in flat order.
template <typename Emit>
void FlatRangeBoxes(const std::vector<int64_t>& sizes, size_t dim, std::vector<int64_t>& prefix,
                    int64_t base, int64_t b, int64_t e, const Emit& emit) {
  if (b >= e) return;
  const size_t rank = sizes.size();
  int64_t stride = 1;  // elements per index of `dim`
  for (size_t d = dim + 1; d < rank; ++d) stride *= sizes[d];
  auto box = [&](int64_t at, int64_t count) {
    std::vector<int64_t> offsets = prefix, extent(prefix.size(), 1);
    offsets.push_back(at);
    extent.push_back(count);
    for (size_t d = dim + 1; d < rank; ++d) offsets.push_back(0), extent.push_back(sizes[d]);
    emit(offsets, extent, base + at * stride);
  };
  if (dim + 1 == rank) return box(b, e - b);
  auto inner = [&](int64_t at, int64_t from, int64_t to) {
    prefix.push_back(at);
    FlatRangeBoxes(sizes, dim + 1, prefix, base + at * stride, from, to, emit);
    prefix.pop_back();
  };
  int64_t first = b / stride;
  const int64_t full_end = e / stride;  // indices [first, full_end) are whole, after the head
  if (first == (e - 1) / stride && (b % stride != 0 || e % stride != 0)) {
    return inner(first, b - first * stride, e - first * stride);
  }
  if (b % stride != 0) inner(first, b % stride, stride), ++first;
  if (full_end > first) box(first, full_end - first);
  if (e % stride != 0) inner(full_end, 0, e % stride);
}

// The original tensor of a DCP tensor `t` Megatron reformulated from global shape `original`.
Status AddNdReformulated(const DcpMetadata& dcp, const DcpTensor& t,
                         const std::vector<int64_t>& original, TensorInfo& info, FileTable& files,
                         Metadata& m, MetadataBudget& budget, const std::string& source) {
  const size_t rank = original.size();
  // Before anything else: FlatRangeBoxes recurses once per dimension and every box it makes
  // copies `rank` offsets, so the rank is bounded first (a shape of 30,000 dimensions once
  // overflowed the stack).
  if (rank > manifest_internal::kMaxRank) {
    return DataLoss(source + ": key '" + t.fqn + "': its N-D reformulated original shape has " +
                    std::to_string(rank) + " dimensions, more than the " +
                    std::to_string(manifest_internal::kMaxRank) + " a tensor may have");
  }
  const std::string where =
      source + ": key '" + t.fqn + "' (N-D reformulated from " + ShapeText(original) + ")";
  if (t.size.size() != rank + 1) {
    return DataLoss(where + ": its DCP shape " + ShapeText(t.size) + " is not " +
                    "axis_fragmentations + (fragment elements,)");
  }
  std::vector<int64_t> local(rank);
  int64_t local_elements = 1;
  for (size_t d = 0; d < rank; ++d) {
    if (original[d] < 0) {
      return DataLoss(where + ": dimension " + std::to_string(d) + " is negative");
    }
    if (t.size[d] <= 0 || original[d] % t.size[d] != 0) {
      return DataLoss(where + ": dimension " + std::to_string(d) + " of " +
                      std::to_string(original[d]) + " is not split into " +
                      std::to_string(t.size[d]) + " equal fragments");
    }
    local[d] = original[d] / t.size[d];
    // Every product below (strides, flat offsets) is at most this count: checked once here.
    if (__builtin_mul_overflow(local_elements, local[d], &local_elements)) {
      return DataLoss(where + ": fragments of shape " + ShapeText(local) +
                      " have more elements than an int64 holds");
    }
  }
  if (local_elements != t.size[rank]) {
    return DataLoss(where + ": fragments of shape " + ShapeText(local) + " have " +
                    std::to_string(local_elements) + " elements, the DCP shape says " +
                    std::to_string(t.size[rank]));
  }
  info.global_shape = original;
  const uint64_t element_size = DTypeSize(info.dtype);
  for (const DcpChunk& c : t.chunks) {
    auto what = [&] { return "key '" + t.fqn + "' chunk at " + ShapeText(c.offsets); };
    for (size_t d = 0; d < rank; ++d) {
      if (c.sizes[d] != 1) return DataLoss(where + ": " + what() + " spans several fragments");
    }
    TESSERA_ASSIGN_OR_RETURN(const ByteLocation location,
                             ItemLocation(dcp.storage[c.storage], files, m, what, source));
    const int64_t start = c.offsets[rank];
    std::vector<int64_t> prefix;
    Status status;
    FlatRangeBoxes(local, 0, prefix, 0, start, start + c.sizes[rank],
                   [&](std::vector<int64_t> offsets, std::vector<int64_t> sizes, int64_t flat) {
                     if (status.ok()) status = budget.Chunk(t.fqn, rank);
                     if (!status.ok()) return;
                     for (size_t d = 0; d < rank; ++d) offsets[d] += c.offsets[d] * local[d];
                     ChunkInfo chunk;
                     chunk.box = Box(std::move(offsets), std::move(sizes));
                     chunk.location = location;
                     chunk.encoding = ChunkEncoding::kTorchSaveItem;
                     chunk.payload_offset = static_cast<uint64_t>(flat - start) * element_size;
                     info.chunks.push_back(std::move(chunk));
                   });
    TESSERA_RETURN_IF_ERROR(status);
  }
  return Status::Ok();
}

// `original`: the global shape Megatron reformulated the tensor from (mcore_data), or null.
Status AddTensor(const DcpMetadata& dcp, const DcpTensor& t, const std::vector<int64_t>* original,
                 FileTable& files, Metadata& m, MetadataBudget& budget, const std::string& source) {
  TensorInfo info;
  info.key = t.fqn;
  Result<DType> dtype = DTypeFromTorchName(t.torch_dtype);
  if (!dtype.ok()) {
    return DataLoss(source + ": key '" + t.fqn + "': " + dtype.status().message());
  }
  info.dtype = *dtype;
  if (original) {
    TESSERA_RETURN_IF_ERROR(AddNdReformulated(dcp, t, *original, info, files, m, budget, source));
    m.tensors.push_back(std::move(info));
    return Status::Ok();
  }
  info.global_shape = t.size;
  const uint64_t element_size = DTypeSize(info.dtype);
  info.chunks.reserve(t.chunks.size());
  for (const DcpChunk& c : t.chunks) {
    auto what = [&] { return "key '" + t.fqn + "' chunk at " + ShapeText(c.offsets); };
    TESSERA_RETURN_IF_ERROR(budget.Chunk(t.fqn, c.offsets.size()));
    if (c.storage >= dcp.storage.size()) [[unlikely]] {
      return DataLoss(source + ": " + what() + " has no storage_data entry");
    }
    ChunkInfo chunk;
    chunk.box = Box(c.offsets, c.sizes);
    TESSERA_ASSIGN_OR_RETURN(chunk.location,
                             ItemLocation(dcp.storage[c.storage], files, m, what, source));
    chunk.encoding = ChunkEncoding::kTorchSaveItem;
    // The item must at least hold the elements (its zip records come on top).
    const uint64_t raw = static_cast<uint64_t>(chunk.box.NumElements()) * element_size;
    if (raw > chunk.location.length) [[unlikely]] {
      return DataLoss(source + ": the item of " + what() + " in '" +
                      dcp.storage[c.storage].relative_path + "' at offset " +
                      Num(chunk.location.offset) + " has " + Num(chunk.location.length) +
                      " bytes, fewer than its " + Num(raw) + " bytes of elements");
    }
    info.chunks.push_back(std::move(chunk));
  }
  m.tensors.push_back(std::move(info));
  return Status::Ok();
}

// Sorts by key; a key twice (a DCP fqn equal to a Megatron file's key) is an error.
template <typename T>
Status SortByKey(std::vector<T>& v, const std::string& source) {
  std::sort(v.begin(), v.end(), [](const T& a, const T& b) { return a.key < b.key; });
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i].key == v[i - 1].key) return DataLoss(source + ": key '" + v[i].key + "' twice");
  }
  return Status::Ok();
}

Result<std::vector<uint8_t>> ReadWhole(const ReadableFile& file, uint64_t limit) {
  if (file.size() > limit) {
    return DataLoss(file.path() + " is " + Num(file.size()) + " bytes, more than the " +
                    Num(limit) + " tessera reads");
  }
  std::vector<uint8_t> bytes(file.size());
  TESSERA_RETURN_IF_ERROR(file.ReadAt(0, bytes.data(), bytes.size()));
  return bytes;
}

// Megatron's metadata.json and common.pt, when `names` lists them: objects of the whole file.
Status AddMegatronFiles(Storage& storage, const std::string& dir,
                        const std::vector<std::string>& names, Metadata& m) {
  for (auto [name, encoding] : {std::pair{kMegatronMetadataJson, ObjectEncoding::kJson},
                                std::pair{kMegatronCommon, ObjectEncoding::kTorchSave}}) {
    if (!std::binary_search(names.begin(), names.end(), std::string(name))) continue;
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                             storage.NewReadableFile(JoinPath(dir, name)));
    const uint32_t index = static_cast<uint32_t>(m.files.size());
    m.files.push_back(FileInfo{name, file->size()});
    m.objects.push_back(ObjectInfo{name, ByteLocation{index, 0, file->size(), 0}, encoding});
  }
  return Status::Ok();
}

}  // namespace

Result<Metadata> DcpToMetadata(const DcpMetadata& dcp,
                               const std::map<std::string, uint64_t>& file_sizes,
                               const std::string& source, uint64_t metadata_bytes) {
  MetadataBudget budget(source, metadata_bytes);
  Metadata m;
  m.format = CheckpointFormat::kTorchDist;
  m.checksum = ChecksumKind::kNone;
  m.save_id = dcp.storage_meta && dcp.storage_meta->save_id ? *dcp.storage_meta->save_id
                                                            : std::string("torch_dist");
  // What the .metadata says of itself, for inspect (docs/FORMAT_TORCH_DIST.md).
  m.user_metadata["torch_dist.flavor"] = dcp.flavor == DcpFlavor::kTorch113 ? "1.13" : "2.x";
  if (dcp.version) m.user_metadata["torch_dist.version"] = *dcp.version;
  if (dcp.megatron_metadata_class || dcp.has_mcore_data || dcp.has_all_local_plans) {
    m.user_metadata["torch_dist.megatron"] = "true";
  }
  if (dcp.planner_data_kind == DcpPlannerData::kFlattenMapping) {
    nlohmann::json paths = nlohmann::json::object();
    bool nested = false;
    for (const DcpPlannerPath& p : dcp.planner_data) {
      nlohmann::json path = nlohmann::json::array();
      for (const DcpPathElement& e : p.path) {
        if (const std::string* s = std::get_if<std::string>(&e)) {
          path.push_back(*s);
        } else {
          path.push_back(std::get<int64_t>(e));
        }
      }
      nested = nested || p.path.size() != 1 || !std::holds_alternative<std::string>(p.path[0]) ||
               std::get<std::string>(p.path[0]) != p.fqn;
      paths[p.fqn] = std::move(path);
    }
    // Bytes that are not UTF-8 are replaced (such a key then matches no fqn and stays flat).
    if (nested) {
      m.user_metadata[kPlannerPathsKey] =
          paths.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
  }
  FileTable files(m, file_sizes, source);
  std::map<std::string, const std::vector<int64_t>*> reformulated;
  for (const DcpMcoreEntry& e : dcp.mcore_data) {
    if (e.nd_reformulated_orig_global_shape) {
      reformulated[e.key] = &*e.nd_reformulated_orig_global_shape;
    }
  }
  m.tensors.reserve(dcp.tensors.size());
  for (const DcpTensor& t : dcp.tensors) {
    auto original = reformulated.find(t.fqn);
    TESSERA_RETURN_IF_ERROR(AddTensor(dcp, t,
                                      original == reformulated.end() ? nullptr : original->second,
                                      files, m, budget, source));
  }
  for (const DcpBytes& b : dcp.bytes) {
    auto what = [&] { return "object '" + b.fqn + "'"; };
    if (b.storage >= dcp.storage.size()) {
      return DataLoss(source + ": " + what() + " has no storage_data entry");
    }
    TESSERA_ASSIGN_OR_RETURN(ByteLocation location,
                             ItemLocation(dcp.storage[b.storage], files, m, what, source));
    m.objects.push_back(ObjectInfo{b.fqn, location, ObjectEncoding::kTorchSave});
  }
  nlohmann::json nd = nlohmann::json::array();
  for (const DcpTensor& t : dcp.tensors) {
    if (reformulated.count(t.fqn)) nd.push_back(t.fqn);
  }
  if (!nd.empty()) m.user_metadata[kNdReformulatedKeys] = nd.dump();
  TESSERA_RETURN_IF_ERROR(SortByKey(m.tensors, source));
  TESSERA_RETURN_IF_ERROR(SortByKey(m.objects, source));
  return m;
}

Result<Metadata> ReadDcpDirectory(Storage& storage, const std::string& dir,
                                  const std::vector<std::string>& names) {
  const std::string path = JoinPath(dir, kDcpMetadataFileName);
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  TESSERA_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWhole(*file, kMaxDcpMetadataBytes));
  Result<DcpMetadata> dcp = ReadDcpMetadata(bytes, path);
  if (!dcp.ok()) {
    // The interpreter's messages name the attribute; make sure they name the file too.
    const std::string& message = dcp.status().message();
    return DataLoss(message.starts_with(path) ? message : path + ": " + message);
  }
  const uint64_t metadata_bytes = bytes.size();
  bytes = {};
  // The size of every data file the .metadata names, each opened once.
  std::map<std::string, uint64_t> sizes;
  for (const DcpStorage& s : dcp->storage) {
    if (sizes.count(s.relative_path)) continue;
    Result<std::unique_ptr<ReadableFile>> data =
        storage.NewReadableFile(JoinPath(dir, s.relative_path));
    if (!data.ok()) {
      if (data.status().code() == StatusCode::kNotFound) {
        return DataLoss(path + " names data file '" + s.relative_path + "' (item of '" + s.fqn +
                        "'), which is missing from " + dir);
      }
      return data.status();
    }
    sizes[s.relative_path] = (*data)->size();
  }
  TESSERA_ASSIGN_OR_RETURN(Metadata m, DcpToMetadata(*dcp, sizes, path, metadata_bytes));
  TESSERA_RETURN_IF_ERROR(AddMegatronFiles(storage, dir, names, m));
  TESSERA_RETURN_IF_ERROR(SortByKey(m.objects, path));
  return m;
}

namespace {

// A chunk that is part of a flat item (an N-D reformulated tensor's): the item's elements are
// row-major contiguous and the chunk's box is the run payload_offset bytes into them.
Status ResolveFlattened(const TorchTensorItem& item, const std::string& what, ChunkInfo& chunk) {
  Result<std::pair<uint64_t, uint64_t>> range = item.ContiguousRange();
  if (!range.ok()) return DataLoss(what + ": " + range.status().message());
  const uint64_t bytes = static_cast<uint64_t>(chunk.box.NumElements()) * item.element_size;
  if (chunk.payload_offset > range->second || bytes > range->second - chunk.payload_offset) {
    return DataLoss(what + " holds " + Num(range->second) + " bytes of elements; the .metadata " +
                    "puts " + Num(bytes) + " of them at byte " + Num(chunk.payload_offset));
  }
  // The whole record, or a part of it (then unchecked, see ChecksumKind::kCrc32).
  const bool whole =
      range->first + chunk.payload_offset == item.data_offset && bytes == item.data_size;
  chunk.location = ByteLocation{chunk.location.file_index,
                                chunk.location.offset + range->first + chunk.payload_offset, bytes,
                                whole ? item.data_crc32 : kUncheckedCrc32};
  chunk.encoding = ChunkEncoding::kRaw;
  chunk.payload_offset = 0;
  chunk.storage_order.clear();
  return Status::Ok();
}

}  // namespace

namespace {

// Reads the item of wrapped chunk `chunk`; errors prefixed with the key and box.
Result<TorchTensorItem> ReadChunkItem(const ReadableFile& file, const TensorInfo& tensor,
                                      const ChunkInfo& chunk, ItemReadStats* stats) {
  Result<TorchTensorItem> read =
      ReadTorchTensorItem(file, chunk.location.offset, chunk.location.length, stats);
  if (!read.ok()) {
    return Status(read.status().code(), "key '" + tensor.key + "' chunk " + chunk.box.ToString() +
                                            ": " + read.status().message());
  }
  return read;
}

// Resolves wrapped `chunk` of `tensor`, whose item (in `file`) is `item`.
Status ResolveWithItem(const TorchTensorItem& item, const ReadableFile& file,
                       const TensorInfo& tensor, ChunkInfo& chunk, bool flattened) {
  const ByteLocation item_at = chunk.location;
  const std::string what = "key '" + tensor.key + "' chunk " + chunk.box.ToString() +
                           ": the item at offset " + Num(item_at.offset) + " of " + file.path();
  Result<DType> dtype = DTypeFromTorchName(item.torch_dtype);
  if (!dtype.ok() || *dtype != tensor.dtype) {
    return DataLoss(what + " holds a " + item.torch_dtype + " tensor; the .metadata says " +
                    std::string(TorchDTypeOf(tensor.dtype).name));
  }
  if (flattened) return ResolveFlattened(item, what, chunk);
  if (chunk.box.sizes != item.size) {
    return DataLoss(what + " holds a tensor of shape " + ShapeText(item.size) +
                    "; the .metadata says " + ShapeText(chunk.box.sizes));
  }
  Result<std::vector<int>> order = item.StorageOrder();
  if (!order.ok()) {
    return Unimplemented(what + ": " + order.status().message() +
                         " (tessera reads row-major blocks and their permutations)");
  }
  const uint64_t element = item.element_size;
  const uint64_t bytes = static_cast<uint64_t>(item.numel()) * element;
  const uint64_t start = item.data_offset + static_cast<uint64_t>(item.storage_offset) * element +
                         chunk.payload_offset;
  // ReadTorchTensorItem checked that the storage lies inside the item and that the view stays
  // inside the storage; the payload offset comes from tessera's own index.
  if (chunk.payload_offset != 0 && (bytes > item_at.length || start > item_at.length - bytes)) {
    return DataLoss(what + ": payload offset " + Num(chunk.payload_offset) +
                    " puts the elements past the item's end");
  }
  // The record's CRC-32 when the chunk's bytes are all of it (torch writes every tensor with a
  // storage of its own size); else unchecked (ChecksumKind::kCrc32).
  const bool whole = start == item.data_offset && bytes == item.data_size;
  chunk.location = ByteLocation{item_at.file_index, item_at.offset + start, bytes,
                                whole ? item.data_crc32 : kUncheckedCrc32};
  chunk.encoding = ChunkEncoding::kRaw;
  chunk.payload_offset = 0;
  chunk.storage_order.clear();
  bool identity = true;
  for (size_t d = 0; d < order->size(); ++d) identity = identity && (*order)[d] == int(d);
  if (!identity && bytes > 0) chunk.storage_order.assign(order->begin(), order->end());
  return Status::Ok();
}

}  // namespace

Status ResolveTorchSaveChunk(const ReadableFile& file, const TensorInfo& tensor, ChunkInfo& chunk,
                             bool flattened, ItemReadStats* stats) {
  if (chunk.encoding != ChunkEncoding::kTorchSaveItem) return Status::Ok();
  TESSERA_ASSIGN_OR_RETURN(const TorchTensorItem item, ReadChunkItem(file, tensor, chunk, stats));
  return ResolveWithItem(item, file, tensor, chunk, flattened);
}

Status ResolveTorchSaveChunks(Storage& storage, const std::string& root, Metadata& metadata,
                              const std::vector<ChunkRef>& chunks, int num_threads,
                              ItemReadStats* stats) {
  // The chunks of each file, so each file is opened once, by one thread.
  std::map<uint32_t, std::vector<ChunkRef>> by_file;
  for (const ChunkRef& ref : chunks) {
    const ChunkInfo& c = metadata.tensors[ref.first].chunks[ref.second];
    if (c.encoding == ChunkEncoding::kTorchSaveItem) by_file[c.location.file_index].push_back(ref);
  }
  if (by_file.empty()) return Status::Ok();
  const std::set<std::string> flattened = NdReformulatedKeys(metadata);
  std::vector<std::pair<uint32_t, const std::vector<ChunkRef>*>> work;
  for (const auto& [file, refs] : by_file) work.emplace_back(file, &refs);
  std::vector<Status> statuses(work.size());
  std::vector<ItemReadStats> costs(work.size());
  std::atomic<size_t> next{0};
  auto run = [&] {
    for (size_t w; (w = next.fetch_add(1)) < work.size();) {
      const FileInfo& info = metadata.files[work[w].first];
      Result<std::unique_ptr<ReadableFile>> file =
          storage.NewReadableFile(JoinPath(root, info.name));
      if (!file.ok()) {
        statuses[w] = file.status();
        continue;
      }
      if ((*file)->size() != info.size) {
        statuses[w] = DataLoss("data file " + (*file)->path() + " has " + Num((*file)->size()) +
                               " bytes; the checkpoint's index says " + Num(info.size));
        continue;
      }
      // The boxes of an N-D reformulated chunk share one item, and come one after another.
      std::optional<ByteLocation> last_at;
      TorchTensorItem last;
      for (const ChunkRef& ref : *work[w].second) {
        TensorInfo& tensor = metadata.tensors[ref.first];
        ChunkInfo& chunk = tensor.chunks[ref.second];
        if (!last_at || *last_at != chunk.location) {
          Result<TorchTensorItem> item = ReadChunkItem(**file, tensor, chunk, &costs[w]);
          if (!item.ok()) {
            statuses[w] = item.status();
            break;
          }
          last = std::move(*item);
          last_at = chunk.location;
        }
        statuses[w] =
            ResolveWithItem(last, **file, tensor, chunk, flattened.count(tensor.key) != 0);
        if (!statuses[w].ok()) break;
      }
    }
  };
  const size_t threads =
      std::clamp<size_t>(static_cast<size_t>(std::max(num_threads, 1)), 1, work.size());
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
  for (size_t w = 0; w < work.size(); ++w) {
    if (stats) stats->reads += costs[w].reads, stats->bytes += costs[w].bytes;
  }
  for (const Status& s : statuses) TESSERA_RETURN_IF_ERROR(s);
  return Status::Ok();
}

std::set<std::string> NdReformulatedKeys(const Metadata& metadata) {
  std::set<std::string> keys;
  auto it = metadata.user_metadata.find(kNdReformulatedKeys);
  if (it == metadata.user_metadata.end()) return keys;
  const Result<nlohmann::json> list = ParseBoundedJson(it->second, kNdReformulatedKeys);
  if (!list.ok() || !list->is_array()) return keys;
  for (const nlohmann::json& key : *list) {
    if (key.is_string()) keys.insert(key.get<std::string>());
  }
  return keys;
}

bool HasTorchSaveChunks(const Metadata& metadata) {
  for (const TensorInfo& t : metadata.tensors) {
    for (const ChunkInfo& c : t.chunks) {
      if (c.encoding == ChunkEncoding::kTorchSaveItem) return true;
    }
  }
  return false;
}

}  // namespace tessera::torch_dist
