#include "format/data_file_headers.h"

#include <algorithm>

#include "format/safetensors.h"

namespace tessera {

Status DataFileHeaders::CheckParses(const ReadableFile& file, uint32_t file_index) {
  std::lock_guard<std::mutex> lock(mu_);
  return ParsedLocked(file, file_index).status;
}

DataFileHeaders::Parsed& DataFileHeaders::ParsedLocked(const ReadableFile& file,
                                                       uint32_t file_index) {
  std::unique_ptr<Parsed>& parsed = files_[file_index];
  if (!parsed) {
    parsed = std::make_unique<Parsed>();
    Result<SafetensorsHeader> header = ReadSafetensorsHeader(file);
    if (header.ok()) {
      parsed->entries.reserve(header->entries.size());
      for (SafetensorsEntry& e : header->entries) {
        parsed->entries.push_back(
            {header->data_start + e.begin, e.end - e.begin, e.dtype, std::move(e.shape)});
      }
      std::stable_sort(parsed->entries.begin(), parsed->entries.end(),
                       [](const Entry& a, const Entry& b) { return a.offset < b.offset; });
    } else {
      parsed->status = header.status();
    }
  }
  return *parsed;
}

Status DataFileHeaders::Check(const ReadableFile& file, uint32_t file_index,
                              const ByteLocation& where, DType dtype, const Shape& shape,
                              const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const Parsed* parsed = &ParsedLocked(file, file_index);
  TESSERA_RETURN_IF_ERROR(parsed->status);
  auto it = std::lower_bound(parsed->entries.begin(), parsed->entries.end(), where.offset,
                             [](const Entry& e, uint64_t offset) { return e.offset < offset; });
  for (; it != parsed->entries.end() && it->offset == where.offset; ++it) {
    // Zero-byte entries may share an offset.
    if (it->length == where.length && it->dtype == dtype && it->shape == shape) {
      return Status::Ok();
    }
  }
  return DataLoss("the safetensors header of " + file.path() + " does not describe " + what +
                  " at offset " + std::to_string(where.offset) + " as the manifest does");
}

}  // namespace tessera
