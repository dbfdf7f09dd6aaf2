#include "format/tessera/names.h"

#include <algorithm>
#include <cstdio>

#include "core/utf8.h"
#include "tessera/storage.h"  // ParsePublishTemporaryName

namespace tessera {
namespace {

constexpr char kDataFileSuffix[] = ".safetensors";
constexpr char kTempManifestPrefix[] = "tessera.manifest.tmp-";
constexpr char kRankManifestPrefix[] = "tessera.manifest.rank-";
constexpr char kNumberedManifestPrefix[] = "tessera.manifest.";
constexpr size_t kSeqDigits = 20;  // every uint64, zero-padded so that names sort as numbers

bool AllDigits(std::string_view s) {
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

}  // namespace

Status CheckDataFileName(std::string_view name) {
  const char* why = nullptr;
  if (name.empty()) {
    why = "is empty";
  } else if (name == "." || name == "..") {
    why = "is a directory reference";
  } else if (name.find('/') != std::string_view::npos) {
    why = "contains '/'";
  } else if (name.find('\0') != std::string_view::npos) {
    why = "contains a NUL byte";
  }
  if (why == nullptr) return Status();
  return InvalidArgument("file name " + QuoteBytes(name) + " is not a plain file name: it " + why);
}

std::string DataFileName(std::string_view save_id, int rank, int file_index,
                         std::string_view attempt) {
  char nums[48];
  if (attempt.empty()) {
    std::snprintf(nums, sizeof(nums), "-r%05d-f%03d", rank, file_index);
  } else {
    std::snprintf(nums, sizeof(nums), "-r%05d-a%.*s-f%03d", rank,
                  static_cast<int>(std::min<size_t>(attempt.size(), kAttemptHexDigits)),
                  attempt.data(), file_index);
  }
  std::string name;
  name.reserve(sizeof(kDataFilePrefix) + save_id.size() + sizeof(nums) + sizeof(kDataFileSuffix));
  name += kDataFilePrefix;
  name += save_id;
  name += nums;
  name += kDataFileSuffix;
  return name;
}

bool IsTesseraDataFileName(std::string_view name) {
  // tsr-<16 lowercase hex>-r<5+ digits>-f<3+ digits>.safetensors
  const std::string_view prefix = kDataFilePrefix;
  const std::string_view suffix = kDataFileSuffix;
  if (!name.starts_with(prefix) || !name.ends_with(suffix)) return false;
  name.remove_prefix(prefix.size());
  name.remove_suffix(suffix.size());
  if (name.size() < kSaveIdHexDigits) return false;
  for (char c : name.substr(0, kSaveIdHexDigits)) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  name.remove_prefix(kSaveIdHexDigits);
  if (!name.starts_with("-r")) return false;
  name.remove_prefix(2);
  const size_t f = name.find("-f");
  if (f == std::string_view::npos) return false;
  std::string_view rank = name.substr(0, f);
  const std::string_view file = name.substr(f + 2);
  // Rank-local saves (format version 3): "-a<attempt>" after the rank.
  if (const size_t a = rank.find("-a"); a != std::string_view::npos) {
    if (!IsAttemptId(rank.substr(a + 2))) return false;
    rank = rank.substr(0, a);
  }
  return rank.size() >= 5 && AllDigits(rank) && file.size() >= 3 && AllDigits(file);
}

bool IsAttemptId(std::string_view attempt) {
  if (attempt.size() != kAttemptHexDigits) return false;
  for (char c : attempt) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string NumberedManifestName(uint64_t seq) {
  char digits[24];
  std::snprintf(digits, sizeof(digits), "%020llu", static_cast<unsigned long long>(seq));
  return std::string(kNumberedManifestPrefix) + digits;
}

bool ParseCommitName(std::string_view name, uint64_t* seq) {
  if (name == kVersion2ManifestFileName) {
    *seq = 0;
    return true;
  }
  if (!name.starts_with(kNumberedManifestPrefix)) return false;
  name.remove_prefix(sizeof(kNumberedManifestPrefix) - 1);
  if (name.size() != kSeqDigits || !AllDigits(name)) return false;
  uint64_t value = 0;
  for (char c : name) {
    if (__builtin_mul_overflow(value, 10, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(c - '0'), &value)) {
      return false;
    }
  }
  if (value == 0) return false;
  *seq = value;
  return true;
}

std::string CommitName(uint64_t seq) {
  return seq == 0 ? std::string(kVersion2ManifestFileName) : NumberedManifestName(seq);
}

std::string RankManifestName(std::string_view save_id, int rank) {
  char digits[16];
  std::snprintf(digits, sizeof(digits), "-r%05d", rank);
  return std::string(kRankManifestPrefix) + std::string(save_id) + digits;
}

bool ParseRankManifestName(std::string_view name, std::string* save_id, int* rank) {
  if (!name.starts_with(kRankManifestPrefix)) return false;
  name.remove_prefix(sizeof(kRankManifestPrefix) - 1);
  const size_t r = name.rfind("-r");
  if (r == std::string_view::npos || r == 0) return false;
  const std::string_view digits = name.substr(r + 2);
  if (digits.size() < 5 || digits.size() > 9 || !AllDigits(digits)) return false;
  *save_id = std::string(name.substr(0, r));
  *rank = std::stoi(std::string(digits));
  return true;
}

std::string TempManifestName(std::string_view save_id) {
  return std::string(kTempManifestPrefix) + std::string(save_id);
}

bool IsTempManifestName(std::string_view name) {
  return name.size() > sizeof(kTempManifestPrefix) - 1 && name.starts_with(kTempManifestPrefix);
}

std::string DataFileTag(std::string_view save_id) { return kDataFilePrefix + std::string(save_id); }

std::string SaveIdOfDataFileName(std::string_view name) {
  if (!IsTesseraDataFileName(name)) return "";
  return std::string(name.substr(sizeof(kDataFilePrefix) - 1, kSaveIdHexDigits));
}

std::string MarkerName(const std::string& id) { return kMarkerPrefix + id; }

std::string MarkerSaveId(const std::string& name) {
  if (!name.starts_with(kMarkerPrefix) || name.ends_with(kVersion2MarkerTempSuffix) ||
      ParsePublishTemporaryName(name, nullptr)) {
    return "";
  }
  std::string id = name.substr(sizeof(kMarkerPrefix) - 1);
  if (id.size() > kSaveIdHexDigits && id[kSaveIdHexDigits] == '.') id.resize(kSaveIdHexDigits);
  return id;
}

}  // namespace tessera
