#include "format/tessera/tessera_writer.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "format/safetensors.h"
#include "format/safetensors_data_file.h"
#include "format/tessera/manifest.h"
#include "format/tessera/names.h"

namespace tessera {
namespace {

class TesseraWriter final : public FormatWriter {
 public:
  std::string DataFileName(const std::string& save_id, int rank, int file_index,
                           const std::string& attempt) const override {
    return tessera::DataFileName(save_id, rank, file_index, attempt);
  }
  bool EngineChecksums() const override { return true; }

  // Objects are u8 vectors of their length; chunks are named by key and box
  // (ChunkEntryName), so any safetensors reader finds them.
  Result<std::unique_ptr<DataFileEncoder>> NewDataFile(const std::vector<ItemToWrite>& items,
                                                       const std::string& save_id) const override {
    std::vector<SafetensorsEntry> entries;
    entries.reserve(items.size());
    for (const ItemToWrite& item : items) {
      SafetensorsEntry e;
      if (item.object) {
        e.name = item.key;
        e.dtype = DType::kU8;
        e.shape = {static_cast<int64_t>(item.num_bytes)};
      } else {
        e.name = ChunkEntryName(item.key, item.box, item.global_shape);
        e.dtype = item.dtype;
        e.shape = item.box.sizes.ToVector();
      }
      entries.push_back(std::move(e));
    }
    LayOutEntries(entries);
    const std::map<std::string, std::string> header_metadata = {{"format", "pt"},
                                                                {"tessera_save_id", save_id}};
    TESSERA_ASSIGN_OR_RETURN(Bytes header, EncodeSafetensorsHeader(entries, header_metadata));
    return NewSafetensorsDataFile(std::move(entries), std::move(header));
  }

  // Numbered manifests (docs/FORMAT.md, section 4): the engine's CommitIndex publishes each
  // create-only as the next tessera.manifest.<n>.
  std::string_view index_description() const override { return "manifest"; }
  bool NumberedCommits() const override { return true; }
  std::string IndexFileName(uint64_t commit_seq) const override {
    return NumberedManifestName(commit_seq);
  }
  Result<Bytes> EncodeIndex(const Metadata& metadata, const std::string& location) const override {
    Bytes bytes = EncodeManifest(metadata);
    TESSERA_RETURN_IF_ERROR(DecodeManifest(bytes, JoinPath(location, "manifest")).status());
    return bytes;
  }
};

}  // namespace

std::unique_ptr<FormatWriter> NewTesseraWriter() { return std::make_unique<TesseraWriter>(); }

}  // namespace tessera
