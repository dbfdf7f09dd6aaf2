#include "format/safetensors_data_file.h"

#include <utility>

namespace tessera {
namespace {

class SafetensorsDataFile final : public DataFileEncoder {
 public:
  SafetensorsDataFile(std::vector<SafetensorsEntry> entries, Bytes header)
      : entries_(std::move(entries)), header_(std::move(header)) {}

  const Bytes& header() const override { return header_; }
  uint64_t ItemOffset(size_t k, uint64_t) const override {
    return header_.size() + entries_[k].begin;
  }
  Result<std::unique_ptr<ItemWriter>> BeginItem(WritableFile& out, size_t k,
                                                uint64_t offset) const override {
    return std::unique_ptr<ItemWriter>(new RawItemWriter(out, offset, Size(k)));
  }
  std::optional<ItemPlacement> PlaceItem(size_t k, uint64_t offset) const override {
    return ItemPlacement{offset, Size(k)};
  }

 private:
  uint64_t Size(size_t k) const { return entries_[k].end - entries_[k].begin; }

  std::vector<SafetensorsEntry> entries_;  // parallel to the items
  Bytes header_;
};

}  // namespace

std::unique_ptr<DataFileEncoder> NewSafetensorsDataFile(std::vector<SafetensorsEntry> entries,
                                                        Bytes header) {
  return std::make_unique<SafetensorsDataFile>(std::move(entries), std::move(header));
}

}  // namespace tessera
