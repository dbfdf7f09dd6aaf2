// tessera inspect / verify.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>

#include <unistd.h>

#include "core/utf8.h"
#include "tessera/checkpoint.h"
#include "tools/commands.h"

namespace tessera::tools {

int Fail(const Status& status) {
  std::fprintf(stderr, "tessera: error: %s\n", status.ToString().c_str());
  return 1;
}

Result<uint64_t> ParseSize(const std::string& text) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  std::string unit = end ? end : "";
  double scale = 0;
  if (unit.empty() || unit == "B")
    scale = 1;
  else if (unit == "KiB" || unit == "K")
    scale = 1024.0;
  else if (unit == "MiB" || unit == "M")
    scale = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "G")
    scale = 1024.0 * 1024 * 1024;
  else if (unit == "KB")
    scale = 1e3;
  else if (unit == "MB")
    scale = 1e6;
  else if (unit == "GB")
    scale = 1e9;
  if (end == text.c_str() || scale == 0 || !(value >= 0)) {
    return InvalidArgument("bad size '" + text + "': expected e.g. 256MiB, 1GiB, 1000000");
  }
  const double bytes = std::round(value * scale);
  // 2^64: the first double a uint64 cannot hold (also rejects inf).
  if (!(bytes < 18446744073709551616.0)) {
    return InvalidArgument("size '" + text + "' is too large (at most 2^64-1 bytes)");
  }
  return static_cast<uint64_t>(bytes);
}

Status CheckFitsInMemory(uint64_t bytes, const std::string& what) {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return Status::Ok();  // unknown: let the allocation decide
  const uint64_t memory = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  if (bytes <= memory) return Status::Ok();
  return InvalidArgument(what + " needs " + FormatBytes(bytes) + " of memory; this machine has " +
                         FormatBytes(memory));
}

Result<std::string> MakeBenchDir(const std::string& requested) {
  std::error_code ec;
  if (!requested.empty()) {
    std::filesystem::create_directories(requested, ec);
    if (ec) return IOError("creating " + requested + ": " + ec.message());
    return requested;
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/tessera-bench-XXXXXX";
  if (!mkdtemp(pattern.data())) return IOErrorFromErrno("mkdtemp " + pattern, errno);
  return pattern;
}

void RemoveBenchDir(const std::string& dir, const std::string& requested) {
  if (!requested.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

std::string FormatBytes(uint64_t bytes) {
  char buf[64];
  if (bytes >= 1000000000ull)
    std::snprintf(buf, sizeof(buf), "%.2f GB", bytes / 1e9);
  else if (bytes >= 1000000ull)
    std::snprintf(buf, sizeof(buf), "%.1f MB", bytes / 1e6);
  else if (bytes >= 1000ull)
    std::snprintf(buf, sizeof(buf), "%.1f kB", bytes / 1e3);
  else
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  return buf;
}

namespace {

// `s` as it is when it is UTF-8 text without control characters, else quoted with every
// other byte escaped (core/utf8.h): what the manifest holds never reaches a terminal raw.
std::string Printable(const std::string& s) {
  const bool plain = IsValidUtf8(s) && std::none_of(s.begin(), s.end(), [](char c) {
                       return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
                     });
  return plain ? s : QuoteBytes(s);
}

}  // namespace

int RunInspect(const std::string& path, bool json) {
  Result<Metadata> metadata = ReadMetadata(path);
  if (!metadata.ok()) return Fail(metadata.status());
  const Metadata& m = *metadata;
  if (json) {
    // JSON strings hold Unicode text: refuse (naming the string) rather than abort inside the
    // JSON library or print silently altered names.
    Status text = CheckMetadataIsUtf8(m, JoinPath(path, "tessera.manifest"));
    if (text.ok() && !IsValidUtf8(path)) {
      text = InvalidArgument("the path " + QuoteBytes(path) + " is not valid UTF-8");
    }
    if (!text.ok()) {
      return Fail(Status(text.code(), text.message() +
                                          "; JSON cannot hold it (`tessera inspect` without "
                                          "--json shows it escaped)"));
    }
  }
  auto tensor_bytes = [](const TensorInfo& t) {
    uint64_t b = 0;
    for (const ChunkInfo& c : t.chunks) b += c.location.length;
    return b;
  };
  if (json) {
    nlohmann::json doc;
    doc["path"] = path;
    doc["format"] = CheckpointFormatName(m.format);
    doc["checksums"] = m.checksum != ChecksumKind::kNone;
    doc["format_version"] = m.format_version;
    doc["save_id"] = m.save_id;
    doc["num_ranks"] = m.num_ranks;
    doc["total_bytes"] = m.TotalTensorBytes();
    doc["total_chunks"] = m.TotalChunks();
    doc["user_metadata"] = m.user_metadata;
    auto& tensors = doc["tensors"] = nlohmann::json::array();
    for (const TensorInfo& t : m.tensors) {
      std::set<uint32_t> files;
      for (const ChunkInfo& c : t.chunks) files.insert(c.location.file_index);
      tensors.push_back({{"key", t.key},
                         {"dtype", std::string(DTypeName(t.dtype))},
                         {"shape", t.global_shape},
                         {"chunks", t.chunks.size()},
                         {"bytes", tensor_bytes(t)},
                         {"files", files.size()}});
    }
    auto& objects = doc["objects"] = nlohmann::json::array();
    for (const ObjectInfo& o : m.objects) {
      objects.push_back({{"key", o.key},
                         {"bytes", o.location.length},
                         {"file", m.files[o.location.file_index].name}});
    }
    auto& files = doc["files"] = nlohmann::json::array();
    for (const FileInfo& f : m.files) files.push_back({{"name", f.name}, {"bytes", f.size}});
    std::cout << doc.dump(2) << "\n";
    return 0;
  }
  if (m.format == CheckpointFormat::kTessera) {
    std::printf("checkpoint %s\n  format v%u, save id %s, saved by %d ranks\n",
                Printable(path).c_str(), m.format_version, m.save_id.c_str(), m.num_ranks);
  } else {
    std::printf("checkpoint %s\n  format %s (no checksums)\n", Printable(path).c_str(),
                CheckpointFormatName(m.format));
  }
  std::printf("  %zu tensors, %zu objects, %llu chunks, %s in %zu files\n", m.tensors.size(),
              m.objects.size(), static_cast<unsigned long long>(m.TotalChunks()),
              FormatBytes(m.TotalTensorBytes()).c_str(), m.files.size());
  for (const auto& [k, v] : m.user_metadata)
    std::printf("  metadata %s = %s\n", Printable(k).c_str(), Printable(v).c_str());
  std::printf("\n%-60s %-8s %-20s %8s %12s\n", "key", "dtype", "shape", "chunks", "bytes");
  for (const TensorInfo& t : m.tensors) {
    std::printf("%-60s %-8s %-20s %8zu %12llu\n", Printable(t.key).c_str(),
                std::string(DTypeName(t.dtype)).c_str(), ShapeToString(t.global_shape).c_str(),
                t.chunks.size(), static_cast<unsigned long long>(tensor_bytes(t)));
  }
  for (const ObjectInfo& o : m.objects) {
    std::printf("%-60s %-8s %-20s %8s %12llu\n", Printable(o.key).c_str(), "object", "-", "-",
                static_cast<unsigned long long>(o.location.length));
  }
  std::printf("\n%-60s %12s\n", "file", "bytes");
  for (const FileInfo& f : m.files) {
    std::printf("%-60s %12llu\n", Printable(f.name).c_str(),
                static_cast<unsigned long long>(f.size));
  }
  return 0;
}

int RunVerify(const std::string& path, int threads) {
  Result<VerifyReport> report = Verify(path, VerifyOptions{.num_threads = threads});
  if (!report.ok()) return Fail(report.status());
  if (!report->checksums) {
    // Nothing to check the bytes against: say so rather than claim they were checked.
    std::printf(
        "verified %s (%s): structure only, the format has no checksums: %llu chunks in %d "
        "files, every header consistent, every tensor covered exactly\n",
        path.c_str(), CheckpointFormatName(report->format),
        static_cast<unsigned long long>(report->chunks_checked), report->files_checked);
    return 0;
  }
  std::printf(
      "verified %s: %llu chunks, %s in %d files; checksums match, every tensor covered "
      "exactly\n",
      path.c_str(), static_cast<unsigned long long>(report->chunks_checked),
      FormatBytes(report->bytes_checked).c_str(), report->files_checked);
  return 0;
}

void AddInspectCommands(CLI::App& app, int* exit_code) {
  auto path = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  CLI::App* inspect =
      app.add_subcommand("inspect", "List the tensors, objects and files of a checkpoint");
  inspect->add_option("PATH", *path, "checkpoint directory")->required();
  inspect->add_flag("--json", *json, "print one JSON document");
  inspect->callback([=] { *exit_code = RunInspect(*path, *json); });

  auto verify_path = std::make_shared<std::string>();
  CLI::App* verify = app.add_subcommand(
      "verify", "Re-read every chunk, check checksums and that chunks cover each tensor exactly");
  verify->add_option("PATH", *verify_path, "checkpoint directory")->required();
  auto verify_threads = std::make_shared<int>(VerifyOptions().num_threads);
  verify->add_option("--threads", *verify_threads, "data files checked at once")
      ->capture_default_str();
  verify->callback([=] { *exit_code = RunVerify(*verify_path, *verify_threads); });
}

}  // namespace tessera::tools
