#include "format/torch_dist/dcp_format_writer.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "format/tessera/names.h"
#include "format/torch_dist/dcp_writer.h"
#include "format/torch_dist/torch_dtype.h"
#include "format/torch_dist/torch_zip.h"

namespace tessera::torch_dist {
namespace {

// One tensor chunk as a torch.save item (TorchTensorItemWriter).
class TensorItem final : public ItemWriter {
 public:
  explicit TensorItem(TorchTensorItemWriter writer) : writer_(std::move(writer)) {}
  Status Append(const std::byte* data, size_t n) override { return writer_.Append(data, n); }
  uint64_t position() const override { return writer_.position(); }
  Result<uint64_t> Finish() override { return writer_.Finish(); }

 private:
  TorchTensorItemWriter writer_;
};

// One object as the byte item of its encoding: the archive forms are built whole, so the bytes
// are gathered first (objects are small) and written by Finish.
class ObjectItem final : public ItemWriter {
 public:
  ObjectItem(WritableFile& out, uint64_t offset, uint64_t num_bytes, ObjectEncoding encoding)
      : out_(&out), offset_(offset), num_bytes_(num_bytes), encoding_(encoding) {
    bytes_.reserve(num_bytes);
  }
  Status Append(const std::byte* data, size_t n) override {
    if (n > num_bytes_ - bytes_.size()) {
      return InvalidArgument("an object of " + std::to_string(num_bytes_) + " bytes was given " +
                             std::to_string(bytes_.size() + n));
    }
    const auto* p = reinterpret_cast<const uint8_t*>(data);
    bytes_.insert(bytes_.end(), p, p + n);
    return Status::Ok();
  }
  uint64_t position() const override { return offset_ + length_; }
  Result<uint64_t> Finish() override {
    if (bytes_.size() != num_bytes_) {
      return FailedPrecondition("an object of " + std::to_string(num_bytes_) +
                                " bytes ended after " + std::to_string(bytes_.size()));
    }
    TESSERA_ASSIGN_OR_RETURN(length_, WriteDcpObjectItem(*out_, offset_, bytes_, encoding_));
    return length_;
  }

 private:
  WritableFile* out_;
  uint64_t offset_;
  uint64_t num_bytes_;
  ObjectEncoding encoding_;
  Bytes bytes_;
  uint64_t length_ = 0;
};

// Items back to back from offset 0; no header.
class DcpDataFile final : public DataFileEncoder {
 public:
  explicit DcpDataFile(std::vector<ItemToWrite> items) : items_(std::move(items)) {}

  const Bytes& header() const override { return header_; }
  uint64_t ItemOffset(size_t, uint64_t end_of_previous) const override { return end_of_previous; }
  Result<std::unique_ptr<ItemWriter>> BeginItem(WritableFile& out, size_t k,
                                                uint64_t offset) const override {
    const ItemToWrite& item = items_[k];
    if (item.object) {
      return std::unique_ptr<ItemWriter>(
          new ObjectItem(out, offset, item.num_bytes, item.object_encoding));
    }
    TESSERA_ASSIGN_OR_RETURN(TorchTensorItemWriter writer,
                             TorchTensorItemWriter::Begin(out, offset, Spec(item)));
    if (writer.layout().data_size != item.num_bytes) {
      return Internal("key '" + item.key + "' box " + item.box.ToString() + ": the item holds " +
                      std::to_string(writer.layout().data_size) + " data bytes, the chunk " +
                      std::to_string(item.num_bytes));
    }
    return std::unique_ptr<ItemWriter>(new TensorItem(std::move(writer)));
  }
  // A tensor's item has a length known from its dtype and shape; an object's only once its
  // pickle is built.
  std::optional<ItemPlacement> PlaceItem(size_t k, uint64_t offset) const override {
    if (items_[k].object) return std::nullopt;
    const Result<TorchItemLayout> layout = TensorLayout(items_[k]);
    if (!layout.ok()) return std::nullopt;
    return ItemPlacement{offset + layout->data_offset, layout->total_size};
  }
  Status WriteFraming(WritableFile& out, size_t k, uint64_t offset,
                      uint32_t data_crc32) const override {
    const ItemToWrite& item = items_[k];
    if (item.object) return FailedPrecondition("key '" + item.key + "': an object is framed whole");
    TESSERA_ASSIGN_OR_RETURN(const TorchItemLayout layout, TensorLayout(item));
    TESSERA_RETURN_IF_ERROR(out.WriteAt(offset, layout.prefix.data(), layout.prefix.size()));
    const std::vector<uint8_t> suffix = TorchItemSuffix(layout, data_crc32);
    return out.WriteAt(offset + layout.data_offset + layout.data_size, suffix.data(),
                       suffix.size());
  }

 private:
  static TorchTensorSpec Spec(const ItemToWrite& item) {
    return TorchTensorSpec{std::string(TorchDTypeOf(item.dtype).name), item.box.sizes.ToVector(),
                           false};
  }
  static Result<TorchItemLayout> TensorLayout(const ItemToWrite& item) {
    Result<TorchItemLayout> layout = LayOutTorchTensorItem(Spec(item));
    if (!layout.ok()) return layout.status().WithContext("key '" + item.key + "'");
    if (layout->data_size != item.num_bytes) {
      return Internal("key '" + item.key + "' box " + item.box.ToString() + ": the item holds " +
                      std::to_string(layout->data_size) + " data bytes, the chunk " +
                      std::to_string(item.num_bytes));
    }
    return layout;
  }

  std::vector<ItemToWrite> items_;
  Bytes header_;  // empty
};

// The files `dcp` references (its storage entries' relative paths).
std::set<std::string> DataFilesOf(const DcpMetadata& dcp) {
  std::set<std::string> files;
  for (const DcpStorage& s : dcp.storage) files.insert(s.relative_path);
  return files;
}

class DcpWriter final : public FormatWriter {
 public:
  DcpWriter(DcpFlavor flavor, std::map<std::string, std::vector<DcpPathElement>> key_paths)
      : flavor_(flavor), key_paths_(std::move(key_paths)) {}

  // The rank-local attempt is tessera's alone (rank-local saves are tessera's format).
  std::string DataFileName(const std::string& save_id, int rank, int file_index,
                           const std::string&) const override {
    return DcpDataFileName(save_id, rank, file_index);
  }
  Status CheckTarget(const std::string& dir, const std::vector<std::string>& names) const override {
    return CheckDcpSaveTarget(dir, names);
  }
  bool EngineChecksums() const override { return false; }  // the zip records' CRC-32

  // torch 1.13 lacks some dtypes (float8, uint16/32/64).
  Status CheckTensor(const std::string& key, DType dtype) const override {
    if (flavor_ != DcpFlavor::kTorch113 || Torch113HasDType(dtype)) return Status::Ok();
    return InvalidArgument("key '" + key + "': torch 1.13 has no dtype " +
                           std::string(TorchDTypeOf(dtype).name) +
                           "; write it with the torch 2.x flavour (TorchDistOptions::flavor "
                           "kTorch2)");
  }
  // Refused before any byte is written.
  Result<std::unique_ptr<DataFileEncoder>> NewDataFile(const std::vector<ItemToWrite>& items,
                                                       const std::string&) const override {
    for (const ItemToWrite& item : items) {
      if (!item.object) TESSERA_RETURN_IF_ERROR(CheckTensor(item.key, item.dtype));
    }
    return std::unique_ptr<DataFileEncoder>(new DcpDataFile(items));
  }

  // One `.metadata`, replaced by every commit (DCP has one index name: the last commit wins).
  std::string_view index_description() const override { return ".metadata"; }
  bool NumberedCommits() const override { return false; }
  std::string IndexFileName(uint64_t) const override { return kDcpMetadataFileName; }
  ChecksumKind FramingChecksum() const override { return ChecksumKind::kCrc32; }
  bool StoresUserMetadata() const override { return false; }
  void FinishIndex(Metadata& metadata) const override { MarkDcpItems(metadata); }
  Result<Bytes> EncodeIndex(const Metadata& metadata, const std::string& location) const override {
    TESSERA_ASSIGN_OR_RETURN(
        const DcpMetadata dcp,
        ToDcpMetadata(metadata,
                      {.flavor = flavor_, .checkpoint_id = location, .key_paths = &key_paths_}));
    return EncodeCheckedDcpMetadata(dcp, JoinPath(location, kDcpMetadataFileName));
  }
  bool ReplacedByLaterSave(std::span<const uint8_t> stored, const std::string& save_id,
                           const std::string& path) const override {
    Result<DcpMetadata> now = ReadDcpMetadata(stored, path);
    if (!now.ok()) return false;
    const std::set<std::string> files = DataFilesOf(*now);
    return std::none_of(files.begin(), files.end(),
                        [&](const std::string& f) { return DcpDataFileSaveId(f) == save_id; });
  }
  // Data files tessera wrote, and the temporary `.metadata` names of a version 2 writer. A
  // DCP directory written by torch keeps every file torch wrote (`__0_0.distcp`), referenced
  // or not.
  std::string SaveIdOfFile(std::string_view name) const override {
    std::string id = DcpDataFileSaveId(name);
    return id.empty() ? TempDcpMetadataSaveId(name) : id;
  }
  Result<std::set<std::string>> FilesOfIndex(std::span<const uint8_t> stored,
                                             const std::string& path) const override {
    TESSERA_ASSIGN_OR_RETURN(const DcpMetadata dcp, ReadDcpMetadata(stored, path));
    return DataFilesOf(dcp);
  }

 private:
  DcpFlavor flavor_;
  // planner_data's path of each key (TorchDistOptions::key_paths).
  std::map<std::string, std::vector<DcpPathElement>> key_paths_;
};

}  // namespace

DcpFlavor DcpFlavorOf(TorchDistFlavor flavor) {
  return flavor == TorchDistFlavor::kTorch113 ? DcpFlavor::kTorch113 : DcpFlavor::kTorch2;
}

Result<TorchDistOptions> ResolveTorchDistOptions(
    const FormatOptions& format_options, TorchDistFlavor flavor,
    const std::map<std::string, std::vector<TorchDistPathElement>>* key_paths,
    const std::string& owner) {
  const TorchDistOptions* set = std::get_if<TorchDistOptions>(&format_options);
  if (set == nullptr) {
    TorchDistOptions options;
    options.flavor = flavor;
    if (key_paths != nullptr) options.key_paths = *key_paths;
    return options;
  }
  const std::string deprecated =
      "is deprecated and " + owner + "::format_options holds TorchDistOptions: set ";
  if (flavor != TorchDistFlavor::kTorch2) {
    return BadOption(owner + "::torch_dist_flavor", deprecated + "TorchDistOptions::flavor only");
  }
  if (key_paths != nullptr && !key_paths->empty()) {
    return BadOption(owner + "::torch_dist_key_paths",
                     deprecated + "TorchDistOptions::key_paths only");
  }
  return *set;
}

Status CheckDcpSaveTarget(const std::string& dir, const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    uint64_t seq = 0;
    if (!ParseCommitName(name, &seq)) continue;
    return FailedPrecondition(
        dir + " holds a tessera checkpoint (" + name +
        "); a PyTorch DCP save there would be hidden by it: save into another directory, or "
        "convert the checkpoint");
  }
  return Status::Ok();
}

Result<Bytes> EncodeCheckedDcpMetadata(const DcpMetadata& dcp, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(const std::vector<uint8_t> encoded, EncodeDcpMetadata(dcp));
  TESSERA_ASSIGN_OR_RETURN(const DcpMetadata check, ReadDcpMetadata(encoded, path));
  DcpMetadata expected = dcp;  // as the reader links it
  TESSERA_RETURN_IF_ERROR(LinkDcpStorage(expected, path));
  if (!(check == expected)) return DataLoss(path + " does not read back as written");
  return Bytes(encoded.begin(), encoded.end());
}

Result<std::unique_ptr<FormatWriter>> NewDcpWriter(const SaveOptions& options, bool coordinator) {
  if (coordinator && !options.user_metadata.empty()) {
    return BadOption("SaveOptions::user_metadata",
                     "must be empty with format torch_dist: a PyTorch DCP "
                     "checkpoint has no place for it (key '" +
                         options.user_metadata.begin()->first + "')");
  }
  TESSERA_ASSIGN_OR_RETURN(
      TorchDistOptions resolved,
      ResolveTorchDistOptions(options.format_options, options.torch_dist_flavor,
                              &options.torch_dist_key_paths, "SaveOptions"));
  return std::unique_ptr<FormatWriter>(
      new DcpWriter(DcpFlavorOf(resolved.flavor), std::move(resolved.key_paths)));
}

}  // namespace tessera::torch_dist
