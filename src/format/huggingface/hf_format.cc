#include "format/huggingface/hf_format.h"

#include <algorithm>

#include "format/huggingface/hf_index.h"
#include "format/huggingface/hf_writer.h"
#include "format/tessera/tessera_format.h"

namespace tessera {
namespace {

bool IsHuggingFaceFile(std::string_view name) {
  return name.ends_with(".safetensors") || name == kHuggingFaceIndexName;
}

class HuggingFaceFormatImpl final : public Format {
 public:
  CheckpointFormat id() const override { return CheckpointFormat::kSafetensors; }
  std::string_view commit_description() const override { return "*.safetensors"; }

  DirectoryClaim Claim(const std::vector<std::string>& names) const override {
    const bool any = std::any_of(names.begin(), names.end(),
                                 [](const std::string& n) { return IsHuggingFaceFile(n); });
    return any ? DirectoryClaim::kData : DirectoryClaim::kNone;
  }
  bool CountsFile(std::string_view name, DirectoryClaim) const override {
    return IsHuggingFaceFile(name);
  }
  bool ClaimsFile(std::string_view file_name) const override {
    return file_name.ends_with(".safetensors");
  }
  bool NestsCheckpoints() const override { return true; }

  Result<FormatIndex> ReadIndex(Storage& storage, const std::string& dir,
                                const std::vector<std::string>& names) const override {
    TESSERA_ASSIGN_OR_RETURN(Metadata m, ReadHuggingFaceDirectory(storage, dir, names));
    TESSERA_ASSIGN_OR_RETURN(Metadata checked, CheckAsManifest(m, dir));
    return FormatIndex{dir, std::move(checked)};
  }
  Result<FormatIndex> ReadFileIndex(Storage& storage, const std::string& dir,
                                    const std::string& name) const override {
    TESSERA_ASSIGN_OR_RETURN(Metadata m, ReadHuggingFaceFile(storage, dir, name));
    TESSERA_ASSIGN_OR_RETURN(Metadata checked, CheckAsManifest(m, JoinPath(dir, name)));
    return FormatIndex{dir, std::move(checked)};
  }

  bool DataFilesHaveHeaders() const override { return true; }

  // Exported to by conversions; never saved (the files have fixed names and no commit file).
  bool CanConvertInto() const override { return true; }
  Result<std::unique_ptr<FormatWriter>> NewConversionWriter(const ConvertOptions&) const override {
    return NewHuggingFaceWriter();
  }
};

}  // namespace

const Format& HuggingFaceFormat() {
  static const HuggingFaceFormatImpl format;
  return format;
}

}  // namespace tessera
