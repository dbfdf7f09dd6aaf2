#include "format/torch_dist/dcp_writer.h"

#include <cctype>

#include "format/torch_dist/torch_dtype.h"

namespace tessera::torch_dist {
namespace {

constexpr std::string_view kSaveIdTag = ".tsr-";
constexpr std::string_view kDataSuffix = ".distcp";
constexpr std::string_view kTempSuffix = ".tmp";
constexpr size_t kSaveIdLength = 16;  // NewSaveId: 16 lowercase hex digits

bool IsSaveId(std::string_view s) {
  if (s.size() != kSaveIdLength) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c)) && (c < 'a' || c > 'f')) return false;
  }
  return true;
}

// Consumes one or more decimal digits at the front of `s`.
bool ConsumeNumber(std::string_view& s) {
  size_t n = 0;
  while (n < s.size() && std::isdigit(static_cast<unsigned char>(s[n]))) ++n;
  s.remove_prefix(n);
  return n > 0;
}

std::string BoxText(const Box& box) { return box.ToString(); }

}  // namespace

// ---- file names -------------------------------------------------------------------------------

std::string DcpDataFileName(std::string_view save_id, int rank, int file_index) {
  return "__" + std::to_string(rank) + "_" + std::to_string(file_index) + std::string(kSaveIdTag) +
         std::string(save_id) + std::string(kDataSuffix);
}

std::string DcpDataFileSaveId(std::string_view name) {
  std::string_view s = name;
  if (!s.starts_with("__")) return "";
  s.remove_prefix(2);
  if (!ConsumeNumber(s) || !s.starts_with('_')) return "";
  s.remove_prefix(1);
  if (!ConsumeNumber(s) || !s.starts_with(kSaveIdTag) || !s.ends_with(kDataSuffix)) return "";
  s.remove_prefix(kSaveIdTag.size());
  s.remove_suffix(kDataSuffix.size());
  return IsSaveId(s) ? std::string(s) : "";
}

std::string TempDcpMetadataName(std::string_view save_id) {
  return std::string(kDcpMetadataFileName) + std::string(kSaveIdTag) + std::string(save_id) +
         std::string(kTempSuffix);
}

std::string TempDcpMetadataSaveId(std::string_view name) {
  const std::string prefix = std::string(kDcpMetadataFileName) + std::string(kSaveIdTag);
  if (!name.starts_with(prefix) || !name.ends_with(kTempSuffix)) return "";
  std::string_view id =
      name.substr(prefix.size(), name.size() - prefix.size() - kTempSuffix.size());
  return IsSaveId(id) ? std::string(id) : "";
}

// ---- items ------------------------------------------------------------------------------------

Result<TorchTensorItemWriter> TorchTensorItemWriter::Begin(WritableFile& file, uint64_t offset,
                                                           const TorchTensorSpec& spec) {
  TESSERA_ASSIGN_OR_RETURN(TorchItemLayout layout, LayOutTorchTensorItem(spec));
  TESSERA_RETURN_IF_ERROR(file.WriteAt(offset, layout.prefix.data(), layout.prefix.size()));
  return TorchTensorItemWriter(file, offset, std::move(layout));
}

Status TorchTensorItemWriter::Append(const void* data, size_t n) {
  if (n > layout_.data_size - crc_.length()) {
    return InvalidArgument("tensor item at " + std::to_string(offset_) + " of " + file_->path() +
                           ": " + std::to_string(crc_.length() + n) + " data bytes appended, " +
                           "the tensor has " + std::to_string(layout_.data_size));
  }
  TESSERA_RETURN_IF_ERROR(file_->WriteAt(position(), data, n));
  // After the write, while the bytes are still in the CPU's cache (as data_files.cc hashes).
  crc_.Update(data, n);
  return Status::Ok();
}

Result<uint64_t> TorchTensorItemWriter::Finish() {
  if (crc_.length() != layout_.data_size) {
    return FailedPrecondition("tensor item at " + std::to_string(offset_) + " of " + file_->path() +
                              ": finished after " + std::to_string(crc_.length()) + " of its " +
                              std::to_string(layout_.data_size) + " data bytes");
  }
  const std::vector<uint8_t> suffix = TorchItemSuffix(layout_, crc_.value());
  TESSERA_RETURN_IF_ERROR(file_->WriteAt(position(), suffix.data(), suffix.size()));
  return layout_.total_size;
}

Result<uint64_t> WriteDcpObjectItem(WritableFile& file, uint64_t offset,
                                    std::span<const uint8_t> data, ObjectEncoding encoding) {
  if (encoding == ObjectEncoding::kTorchSave) {
    TESSERA_RETURN_IF_ERROR(file.WriteAt(offset, data.data(), data.size()));
    return data.size();
  }
  const std::vector<uint8_t> item =
      encoding == ObjectEncoding::kPickle ? MakeTorchObjectItem(data) : MakeTorchBytesItem(data);
  TESSERA_RETURN_IF_ERROR(file.WriteAt(offset, item.data(), item.size()));
  return item.size();
}

// ---- the index --------------------------------------------------------------------------------

bool Torch113HasDType(DType dtype) { return !TorchDTypeOf(dtype).storage_class.empty(); }

void MarkDcpItems(Metadata& metadata) {
  metadata.format = CheckpointFormat::kTorchDist;
  metadata.checksum = ChecksumKind::kNone;
  metadata.checksum_block_bytes = 0;
  for (TensorInfo& tensor : metadata.tensors) {
    for (ChunkInfo& chunk : tensor.chunks) {
      chunk.encoding = ChunkEncoding::kTorchSaveItem;
      chunk.payload_offset = 0;
      chunk.storage_order.clear();
      chunk.block_checksums.clear();
      chunk.location.checksum = 0;
    }
  }
  for (ObjectInfo& object : metadata.objects) {
    object.encoding = ObjectEncoding::kTorchSave;
    object.location.checksum = 0;
  }
}

Result<DcpMetadata> ToDcpMetadata(const Metadata& metadata, const DcpIndexOptions& options) {
  DcpMetadata m;
  m.flavor = options.flavor;
  const bool v2 = options.flavor == DcpFlavor::kTorch2;
  auto file_of = [&](const ByteLocation& location, const std::string& what) -> Result<std::string> {
    if (location.file_index >= metadata.files.size()) {
      return InvalidArgument(what + ": file index " + std::to_string(location.file_index) + " of " +
                             std::to_string(metadata.files.size()) + " files");
    }
    return metadata.files[location.file_index].name;
  };
  for (const TensorInfo& tensor : metadata.tensors) {
    const TorchDType& dtype = TorchDTypeOf(tensor.dtype);
    if (!v2 && dtype.storage_class.empty()) {
      return InvalidArgument("key '" + tensor.key + "': torch 1.13 has no dtype " +
                             std::string(dtype.name) + "; write the torch 2.x flavour");
    }
    DcpTensor t;
    t.fqn = tensor.key;
    t.torch_dtype = std::string(dtype.name);
    t.size = tensor.global_shape;
    for (size_t c = 0; c < tensor.chunks.size(); ++c) {
      const ChunkInfo& chunk = tensor.chunks[c];
      const std::string what = "key '" + tensor.key + "' box " + BoxText(chunk.box);
      if (chunk.encoding != ChunkEncoding::kTorchSaveItem || chunk.payload_offset != 0 ||
          !chunk.storage_order.empty()) {
        return InvalidArgument(what + ": not stored as a whole row-major tensor item");
      }
      TESSERA_ASSIGN_OR_RETURN(std::string file, file_of(chunk.location, what));
      t.chunks.push_back(DcpChunk{chunk.box.offsets.ToVector(), chunk.box.sizes.ToVector()});
      m.storage.push_back(DcpStorage{tensor.key, chunk.box.offsets.ToVector(),
                                     static_cast<int64_t>(c), std::move(file),
                                     chunk.location.offset, chunk.location.length});
    }
    m.tensors.push_back(std::move(t));
  }
  for (const ObjectInfo& object : metadata.objects) {
    TESSERA_ASSIGN_OR_RETURN(std::string file,
                             file_of(object.location, "object '" + object.key + "'"));
    m.bytes.push_back(DcpBytes{object.key});
    m.storage.push_back(DcpStorage{object.key, std::nullopt, std::nullopt, std::move(file),
                                   object.location.offset, object.location.length});
  }
  if (v2) {
    m.planner_data_kind = DcpPlannerData::kFlattenMapping;
    auto path_of = [&](const std::string& fqn) {
      std::vector<DcpPathElement> path{fqn};
      if (options.key_paths == nullptr) return path;
      const auto it = options.key_paths->find(fqn);
      if (it == options.key_paths->end() || it->second.empty()) return path;
      return std::vector<DcpPathElement>(it->second.begin(), it->second.end());
    };
    for (const DcpTensor& t : m.tensors) m.planner_data.push_back({t.fqn, path_of(t.fqn)});
    for (const DcpBytes& b : m.bytes) m.planner_data.push_back({b.fqn, path_of(b.fqn)});
    DcpStorageMeta meta;
    if (!options.checkpoint_id.empty()) meta.checkpoint_id = options.checkpoint_id;
    if (!metadata.save_id.empty()) meta.save_id = metadata.save_id;
    m.storage_meta = std::move(meta);
    m.version = "1.0.0";
  }
  if (Status linked = LinkDcpStorage(m, "the .metadata of save " + metadata.save_id);
      !linked.ok()) {
    return InvalidArgument(linked.message());
  }
  return m;
}

}  // namespace tessera::torch_dist
