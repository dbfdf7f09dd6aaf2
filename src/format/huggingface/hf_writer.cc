#include "format/huggingface/hf_writer.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "format/huggingface/hf_export.h"
#include "format/huggingface/hf_index.h"
#include "format/safetensors.h"
#include "format/safetensors_data_file.h"

namespace tessera {
namespace {

class HuggingFaceWriter final : public FormatWriter {
 public:
  // A save never writes this format (Format::NewWriter refuses it); a conversion names its
  // files by ConversionFileName. As if file `file_index` were the last of the set.
  std::string DataFileName(const std::string&, int, int file_index,
                           const std::string&) const override {
    return ConversionFileName("", 0, file_index, file_index, file_index + 1);
  }
  std::string ConversionFileName(const std::string&, int, int, int file, int count) const override {
    return count == 1 ? kHuggingFaceSingleFileName : HuggingFaceShardName(file, count);
  }
  bool EngineChecksums() const override { return false; }

  // Whole tensors under their keys; objects have no place (StoresObjects).
  Result<std::unique_ptr<DataFileEncoder>> NewDataFile(const std::vector<ItemToWrite>& items,
                                                       const std::string&) const override {
    std::vector<SafetensorsEntry> entries;
    entries.reserve(items.size());
    for (const ItemToWrite& item : items) {
      if (item.object) {
        return InvalidArgument("key '" + item.key +
                               "' is an object, and Hugging Face safetensors files hold "
                               "tensors only");
      }
      if (item.box.sizes != item.global_shape) {
        return InvalidArgument("key '" + item.key + "' box " + item.box.ToString() +
                               ": Hugging Face safetensors files hold whole tensors only");
      }
      entries.push_back(SafetensorsEntry{item.key, item.dtype, item.global_shape});
    }
    LayOutEntries(entries);
    TESSERA_ASSIGN_OR_RETURN(Bytes header, EncodeSafetensorsHeader(entries, {{"format", "pt"}}));
    return NewSafetensorsDataFile(std::move(entries), std::move(header));
  }

  // model.safetensors.index.json, only for shards (transformers writes none for one file),
  // created once: a conversion never replaces another's.
  std::string_view index_description() const override { return kHuggingFaceIndexName; }
  bool NumberedCommits() const override { return false; }
  std::string IndexFileName(uint64_t) const override { return kHuggingFaceIndexName; }
  Result<Bytes> EncodeIndex(const Metadata& metadata, const std::string&) const override {
    uint64_t total_size = 0;
    std::vector<std::pair<std::string, std::string>> weight_map;
    for (const TensorInfo& t : metadata.tensors) {
      if (t.chunks.size() != 1 || t.chunks[0].location.file_index >= metadata.files.size()) {
        return Internal("key '" + t.key + "' is not one whole tensor in one of the files");
      }
      total_size +=
          static_cast<uint64_t>(Box::Whole(t.global_shape).NumElements()) * DTypeSize(t.dtype);
      weight_map.emplace_back(t.key, metadata.files[t.chunks[0].location.file_index].name);
    }
    TESSERA_ASSIGN_OR_RETURN(const std::string text,
                             EncodeHuggingFaceIndex(total_size, weight_map));
    return Bytes(text.begin(), text.end());
  }

  bool FilesAreTheCheckpoint() const override { return true; }
  bool NeedsIndex(size_t num_files) const override { return num_files > 1; }
  bool StoresObjects() const override { return false; }
  bool StoresUserMetadata() const override { return false; }
};

}  // namespace

std::unique_ptr<FormatWriter> NewHuggingFaceWriter() {
  return std::make_unique<HuggingFaceWriter>();
}

}  // namespace tessera
