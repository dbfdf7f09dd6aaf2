#include "checkpoint/dcp_data_files.h"

#include <algorithm>

#include "checkpoint/item_source.h"
#include "format/torch_dist/dcp_writer.h"
#include "format/torch_dist/torch_dtype.h"

namespace tessera {
namespace {

// Hands what was written since `begin` to the device once it reaches kWritebackStep (kFull).
struct Writeback {
  WritableFile& out;
  bool durable;
  uint64_t begin = 0;
  Status After(uint64_t end) {
    if (!durable || end - begin < kWritebackStep) return Status::Ok();
    TESSERA_RETURN_IF_ERROR(out.StartWriteback(begin, end - begin));
    begin = end;
    return Status::Ok();
  }
};

// One tensor chunk as a torch.save item at `at`; returns the item's length.
Result<uint64_t> WriteTensorItem(WritableFile& out, uint64_t at, const LocalItem& item,
                                 ItemReader& data, Writeback& writeback,
                                 std::atomic<uint64_t>& written) {
  const torch_dist::TorchTensorSpec spec{std::string(torch_dist::TorchDTypeOf(item.dtype).name),
                                         item.box.sizes, false};
  TESSERA_ASSIGN_OR_RETURN(torch_dist::TorchTensorItemWriter writer,
                           torch_dist::TorchTensorItemWriter::Begin(out, at, spec));
  if (writer.layout().data_size != item.num_bytes) {
    return Internal("key '" + item.key + "' box " + item.box.ToString() + ": the item holds " +
                    std::to_string(writer.layout().data_size) + " data bytes, the chunk " +
                    std::to_string(item.num_bytes));
  }
  for (uint64_t done = 0; done < item.num_bytes;) {
    TESSERA_ASSIGN_OR_RETURN(std::span<const std::byte> bytes,
                             data.Next(std::min(kWritePiece, item.num_bytes - done)));
    const size_t n = bytes.size();
    TESSERA_RETURN_IF_ERROR(writer.Append(bytes.data(), n));
    written.fetch_add(n, std::memory_order_relaxed);
    done += n;
    TESSERA_RETURN_IF_ERROR(writeback.After(writer.position()));
  }
  return writer.Finish();
}

// Writes one data file: its items back to back from offset 0.
Status WriteDcpDataFile(Storage& storage, const std::string& dir, const StateDict& state,
                        ItemSource& source, const LocalPlan& plan, uint32_t file_index,
                        const DataFilePlan& file, const DataFileWriteOptions& options,
                        std::atomic<uint64_t>& written, std::vector<WrittenItem>& items,
                        uint64_t& size, uint8_t& created) {
  TESSERA_ASSIGN_OR_RETURN(
      std::unique_ptr<WritableFile> out,
      storage.NewWritableFile(JoinPath(dir, file.name), CreateMode::kExclusive));
  created = 1;
  const bool durable = options.sync == SyncPolicy::kFull;
  Writeback writeback{*out, durable};
  uint64_t at = 0;
  for (size_t k = 0; k < file.items.size(); ++k) {
    const uint32_t i = file.items[k];
    const LocalItem& item = plan.items[i];
    uint64_t length = 0;
    if (item.kind == ItemKind::kTensor) {
      ItemReader data(source, file_index, k, item.num_bytes);
      TESSERA_ASSIGN_OR_RETURN(length, WriteTensorItem(*out, at, item, data, writeback, written));
    } else {
      const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(ItemData(state, item)),
                                           item.num_bytes);
      TESSERA_ASSIGN_OR_RETURN(
          length, torch_dist::WriteDcpObjectItem(*out, at, bytes, item.object_encoding));
      written.fetch_add(item.num_bytes, std::memory_order_relaxed);
      TESSERA_RETURN_IF_ERROR(writeback.After(at + length));
    }
    items.push_back(WrittenItem{i, file_index, at, length, 0});
    at += length;
  }
  size = at;
  if (durable) TESSERA_RETURN_IF_ERROR(out->Sync());
  return out->Close();
}

// torch 1.13 lacks some dtypes: refused before any byte is written.
Status CheckDTypes(const LocalPlan& plan, const std::vector<DataFilePlan>& files,
                   torch_dist::DcpFlavor flavor) {
  if (flavor != torch_dist::DcpFlavor::kTorch113) return Status::Ok();
  for (const DataFilePlan& file : files) {
    for (uint32_t i : file.items) {
      const LocalItem& item = plan.items[i];
      if (item.kind == ItemKind::kTensor && !torch_dist::Torch113HasDType(item.dtype)) {
        return InvalidArgument("key '" + item.key + "': torch 1.13 has no dtype " +
                               std::string(torch_dist::TorchDTypeOf(item.dtype).name) +
                               "; save with the torch 2.x flavour (TorchDistFlavor::kTorch2)");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

std::vector<DataFilePlan> PlanDcpDataFiles(const LocalPlan& plan,
                                           const std::vector<uint32_t>& items, int files_per_group,
                                           const std::vector<std::string>& separate_prefixes,
                                           const std::string& save_id, int rank) {
  std::vector<DataFilePlan> files =
      PlanDataFiles(plan, items, files_per_group, separate_prefixes, save_id, rank);
  for (size_t f = 0; f < files.size(); ++f) {
    files[f].name = torch_dist::DcpDataFileName(save_id, rank, static_cast<int>(f));
  }
  return files;
}

Result<WriteResult> WriteDcpDataFiles(Storage& storage, const std::string& dir,
                                      const StateDict& state, const LocalPlan& plan,
                                      const std::vector<DataFilePlan>& files,
                                      torch_dist::DcpFlavor flavor,
                                      const DataFileWriteOptions& options) {
  TESSERA_RETURN_IF_ERROR(CheckDTypes(plan, files, flavor));
  std::vector<std::vector<WrittenItem>> items(files.size());
  std::vector<uint64_t> sizes(files.size(), 0);
  std::atomic<uint64_t> written{0};
  TESSERA_RETURN_IF_ERROR(WriteFilesFromSource(
      storage, dir, state, plan, files, options, written,
      [&](ItemSource& source, size_t f, uint8_t& created) {
        return WriteDcpDataFile(storage, dir, state, source, plan, static_cast<uint32_t>(f),
                                files[f], options, written, items[f], sizes[f], created);
      }));
  WriteResult result;
  for (size_t f = 0; f < files.size(); ++f) {
    result.files.push_back(FileInfo{files[f].name, sizes[f]});
    result.items.insert(result.items.end(), items[f].begin(), items[f].end());
  }
  return result;
}

}  // namespace tessera
