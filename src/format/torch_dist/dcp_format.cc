#include "format/torch_dist/dcp_format.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <thread>

#include "format/tessera/tessera_format.h"
#include "format/torch_dist/dcp_codec.h"
#include "format/torch_dist/dcp_format_writer.h"
#include "format/torch_dist/dcp_writer.h"
#include "format/torch_dist/torch_zip.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"

namespace tessera {
namespace {

using torch_dist::ItemReadStats;

bool IsDistcp(std::string_view name) { return name.ends_with(".distcp"); }

// Every wrapped chunk resolved (each item's zip directory and data.pkl must be sound and
// describe the dtype and shape the index says), and the zip directory of every torch.save
// object read.
Status CheckItemStructure(Storage& storage, const std::string& root, const Metadata& metadata,
                          int num_threads, ItemReadStats& stats) {
  if (torch_dist::HasTorchSaveChunks(metadata)) {
    std::vector<ChunkRef> all;
    for (uint32_t t = 0; t < metadata.tensors.size(); ++t) {
      for (uint32_t c = 0; c < metadata.tensors[t].chunks.size(); ++c) all.emplace_back(t, c);
    }
    Metadata copy = metadata;
    TESSERA_RETURN_IF_ERROR(
        torch_dist::ResolveTorchSaveChunks(storage, root, copy, all, num_threads, &stats));
  }
  for (const ObjectInfo& object : metadata.objects) {
    if (object.encoding != ObjectEncoding::kTorchSave) continue;
    const std::string path = JoinPath(root, metadata.files[object.location.file_index].name);
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
    Result<torch_dist::TorchObjectItem> item = torch_dist::ReadTorchObjectItem(
        *file, object.location.offset, object.location.length, &stats);
    if (!item.ok()) {
      return Status(item.status().code(),
                    "object '" + object.key + "': " + item.status().message());
    }
  }
  return Status::Ok();
}

// The CRC-32 of every zip record of every item (tensor chunks' and torch.save objects'), each
// item once (the boxes of an N-D reformulated chunk share theirs), `num_threads` files at a
// time, each read in offset order. Errors name the file, the item's offset and the record.
Status CheckItemRecords(Storage& storage, const std::string& root, const Metadata& metadata,
                        int num_threads, uint64_t* bytes_checked) {
  std::map<uint32_t, std::set<std::pair<uint64_t, uint64_t>>> items;  // file -> (offset, length)
  for (const TensorInfo& t : metadata.tensors) {
    for (const ChunkInfo& c : t.chunks) {
      if (c.encoding != ChunkEncoding::kTorchSaveItem) continue;
      items[c.location.file_index].emplace(c.location.offset, c.location.length);
    }
  }
  for (const ObjectInfo& o : metadata.objects) {
    if (o.encoding != ObjectEncoding::kTorchSave) continue;
    items[o.location.file_index].emplace(o.location.offset, o.location.length);
  }
  std::vector<std::pair<uint32_t, const std::set<std::pair<uint64_t, uint64_t>>*>> work;
  for (const auto& [file, list] : items) work.emplace_back(file, &list);
  std::vector<Status> statuses(work.size());
  std::vector<uint64_t> checked(work.size(), 0);
  std::atomic<size_t> next{0};
  auto run = [&] {
    for (size_t w; (w = next.fetch_add(1)) < work.size();) {
      const std::string path = JoinPath(root, metadata.files[work[w].first].name);
      Result<std::unique_ptr<ReadableFile>> file = storage.NewReadableFile(path);
      if (!file.ok()) {
        statuses[w] = file.status();
        continue;
      }
      for (const auto& [offset, length] : *work[w].second) {
        statuses[w] =
            torch_dist::CheckTorchItemRecords(**file, offset, length, nullptr, &checked[w]);
        if (!statuses[w].ok()) break;
      }
    }
  };
  const size_t threads = std::clamp<size_t>(static_cast<size_t>(std::max(num_threads, 1)), 1,
                                            std::max<size_t>(work.size(), 1));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
  for (size_t w = 0; w < work.size(); ++w) {
    TESSERA_RETURN_IF_ERROR(statuses[w]);
    if (bytes_checked) *bytes_checked += checked[w];
  }
  return Status::Ok();
}

class TorchDistFormatImpl final : public Format {
 public:
  CheckpointFormat id() const override { return CheckpointFormat::kTorchDist; }
  std::string_view commit_description() const override { return "PyTorch DCP .metadata"; }

  // DCP writes .metadata last: data files without it are a save that did not finish.
  DirectoryClaim Claim(const std::vector<std::string>& names) const override {
    if (std::binary_search(names.begin(), names.end(), torch_dist::kDcpMetadataFileName)) {
      return DirectoryClaim::kCommitted;
    }
    if (std::any_of(names.begin(), names.end(), [](const std::string& n) { return IsDistcp(n); })) {
      return DirectoryClaim::kUnfinished;
    }
    return DirectoryClaim::kNone;
  }
  // A committed DCP directory is all its files (Megatron adds metadata.json and common.pt).
  bool CountsFile(std::string_view name, DirectoryClaim claim) const override {
    return claim == DirectoryClaim::kCommitted || IsDistcp(name);
  }

  Result<FormatIndex> ReadIndex(Storage& storage, const std::string& dir,
                                const std::vector<std::string>& names) const override {
    TESSERA_ASSIGN_OR_RETURN(Metadata m, torch_dist::ReadDcpDirectory(storage, dir, names));
    TESSERA_ASSIGN_OR_RETURN(Metadata checked, CheckAsManifest(m, dir));
    return FormatIndex{dir, std::move(checked)};
  }

  bool DataFilesHaveHeaders() const override { return false; }
  bool HasWrappedChunks(const Metadata& metadata) const override {
    return torch_dist::HasTorchSaveChunks(metadata);
  }
  // Resolved chunks carry their zip records' CRC-32s (dcp_codec.h), checked as they are read.
  ChecksumKind resolved_checksum() const override { return ChecksumKind::kCrc32; }
  Status ResolveWrappedChunks(Storage& storage, const std::string& root, Metadata& metadata,
                              const std::vector<ChunkRef>& chunks, int num_threads,
                              FormatReadStats* stats) const override {
    ItemReadStats read;
    Status status =
        torch_dist::ResolveTorchSaveChunks(storage, root, metadata, chunks, num_threads, &read);
    if (stats) {
      stats->bytes += read.bytes;
      stats->reads += read.reads;
    }
    return status;
  }
  Status VerifyItems(Storage& storage, const std::string& root, const Metadata& metadata,
                     int num_threads, uint64_t* structure_bytes, uint64_t* bytes_checked,
                     bool* checksummed) const override {
    ItemReadStats stats;
    TESSERA_RETURN_IF_ERROR(CheckItemStructure(storage, root, metadata, num_threads, stats));
    if (structure_bytes) *structure_bytes += stats.bytes;
    // Every zip record carries a CRC-32 (issue 22), all checked.
    TESSERA_RETURN_IF_ERROR(CheckItemRecords(storage, root, metadata, num_threads, bytes_checked));
    if (checksummed) *checksummed = true;
    return Status::Ok();
  }
  // A torch.save item: the CRC-32 of every zip record (issue 22).
  Result<bool> CheckObjectBytes(const ObjectInfo& object, const std::vector<uint8_t>& bytes,
                                const std::string& where) const override {
    if (object.encoding != ObjectEncoding::kTorchSave) return false;
    TESSERA_RETURN_IF_ERROR(torch_dist::CheckTorchItemRecords(bytes, where, nullptr));
    return true;
  }

  bool CanWrite() const override { return true; }
  Status CheckOptions(const FormatOptions& options, const std::string& field) const override {
    if (std::holds_alternative<TorchDistOptions>(options)) return Status::Ok();
    return Format::CheckOptions(options, field);
  }
  Result<std::unique_ptr<FormatWriter>> NewWriter(const SaveOptions& options,
                                                  bool coordinator) const override {
    return torch_dist::NewDcpWriter(options, coordinator);
  }
  // With the deprecated ConvertOptions::torch_dist_flavor folded in.
  Result<std::unique_ptr<FormatWriter>> NewConversionWriter(
      const ConvertOptions& options) const override {
    SaveOptions as_save;
    as_save.format = id();
    TESSERA_ASSIGN_OR_RETURN(
        as_save.format_options,
        torch_dist::ResolveTorchDistOptions(options.format_options, options.torch_dist_flavor,
                                            /*key_paths=*/nullptr, "ConvertOptions"));
    return torch_dist::NewDcpWriter(as_save, /*coordinator=*/true);
  }
};

}  // namespace

const Format& TorchDistFormat() {
  static const TorchDistFormatImpl format;
  return format;
}

}  // namespace tessera
