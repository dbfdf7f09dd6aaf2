#include "tessera/format.h"

#include "format/registry.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"

namespace tessera {

// The defaults: a format with no single-file checkpoints, no wrapped chunks and no checks of
// its own beyond tessera's block checksums and the safetensors headers.

Result<FormatIndex> Format::ReadFileIndex(Storage&, const std::string& dir,
                                          const std::string& file_name) const {
  return FailedPrecondition(JoinPath(dir, file_name) + " is a file, and a " + name() +
                            " checkpoint is a directory");
}

Status Format::ResolveWrappedChunks(Storage&, const std::string&, Metadata&,
                                    const std::vector<ChunkRef>&, int, FormatReadStats*) const {
  return Status::Ok();
}

Status Format::VerifyItems(Storage&, const std::string&, const Metadata&, int, uint64_t*, uint64_t*,
                           bool*) const {
  return Status::Ok();
}

Result<bool> Format::CheckObjectBytes(const ObjectInfo&, const std::vector<uint8_t>&,
                                      const std::string&) const {
  return false;
}

namespace {

// The names of the registered formats `can` says yes to, joined by `separator`.
std::string NamesOf(bool (Format::*can)() const, const char* separator) {
  std::string names;
  for (const Format* format : RegisteredFormats()) {
    if (!(format->*can)()) continue;
    names += std::string(names.empty() ? "" : separator) + format->name();
  }
  return names;
}

}  // namespace

Result<std::unique_ptr<FormatWriter>> Format::NewWriter(const SaveOptions&, bool) const {
  return InvalidArgument(std::string("SaveOptions::format ") + name() +
                         " cannot be written: save as " + NamesOf(&Format::CanWrite, " or "));
}

Result<std::unique_ptr<FormatWriter>> Format::NewConversionWriter(
    const ConvertOptions& options) const {
  if (!CanWrite()) {
    return InvalidArgument(std::string("ConvertOptions::to ") + name() +
                           " cannot be converted into: convert into " +
                           NamesOf(&Format::CanConvertInto, ", "));
  }
  SaveOptions as_save;
  as_save.format = id();
  as_save.format_options = options.format_options;
  return NewWriter(as_save, /*coordinator=*/true);
}

Status Format::CheckOptions(const FormatOptions& options, const std::string& field) const {
  if (std::holds_alternative<std::monostate>(options)) return Status::Ok();
  return BadOption(field, "holds " + FormatOptionsName(options) + ", options the format " + name() +
                              " does not take (each options struct goes with its own format)");
}

std::string FormatOptionsName(const FormatOptions& options) {
  static_assert(std::variant_size_v<FormatOptions> == 2, "name each alternative below");
  return std::holds_alternative<TorchDistOptions>(options) ? "TorchDistOptions" : "";
}

Status RawItemWriter::Append(const std::byte* data, size_t n) {
  if (n > num_bytes_ - done_) {
    return InvalidArgument("an item of " + std::to_string(num_bytes_) + " bytes was given " +
                           std::to_string(done_ + n));
  }
  TESSERA_RETURN_IF_ERROR(out_->WriteAt(offset_ + done_, data, n));
  done_ += n;
  return Status::Ok();
}

Result<uint64_t> RawItemWriter::Finish() {
  if (done_ != num_bytes_) {
    return FailedPrecondition("an item of " + std::to_string(num_bytes_) + " bytes ended after " +
                              std::to_string(done_));
  }
  return num_bytes_;
}

}  // namespace tessera
