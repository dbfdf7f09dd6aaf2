#include "format/huggingface/hf_index.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "format/bounded_json.h"
#include "format/safetensors.h"
#include "format/tessera/manifest.h"

namespace tessera {
namespace {

// An index JSON longer than this is refused before it is read (real ones are a few hundred
// KB: one line per tensor).
constexpr uint64_t kMaxIndexBytes = 256u << 20;
constexpr char kSuffix[] = ".safetensors";

// Reads the header of `dir`/`name` and appends its entries as tensors (one whole chunk each)
// to `m`, with `name` as file `m.files.size()`. `wanted` (when not null) is the set of tensor
// names the index puts in this file: every one must be there, and only those are taken.
Status AddFile(Storage& storage, const std::string& dir, const std::string& name,
               const std::set<std::string>* wanted, Metadata& m) {
  const std::string path = JoinPath(dir, name);
  Result<std::unique_ptr<ReadableFile>> opened = storage.NewReadableFile(path);
  if (!opened.ok()) {
    if (opened.status().code() == StatusCode::kNotFound) {
      return DataLoss("safetensors file " + path + " named by " +
                      JoinPath(dir, kHuggingFaceIndexName) + " is missing");
    }
    return opened.status();
  }
  const ReadableFile& file = **opened;
  TESSERA_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(file));
  const uint32_t file_index = static_cast<uint32_t>(m.files.size());
  m.files.push_back(FileInfo{name, file.size()});
  std::set<std::string> found;
  for (const SafetensorsEntry& e : header.entries) {
    if (wanted && !wanted->count(e.name)) continue;
    found.insert(e.name);
    TensorInfo t;
    t.key = e.name;
    t.dtype = e.dtype;
    t.global_shape = e.shape;
    ChunkInfo c;
    c.box = Box::Whole(e.shape);
    c.location = ByteLocation{file_index, header.data_start + e.begin, e.end - e.begin, 0};
    t.chunks.push_back(std::move(c));
    m.tensors.push_back(std::move(t));
  }
  if (wanted && found.size() != wanted->size()) {
    for (const std::string& n : *wanted) {
      if (!found.count(n)) {
        return DataLoss(JoinPath(dir, kHuggingFaceIndexName) + " puts tensor '" + n + "' in " +
                        path + ", whose header does not list it");
      }
    }
  }
  for (const auto& [k, v] : header.metadata) m.user_metadata.emplace(k, v);
  return Status::Ok();
}

// Sorts the tensors by key; a key in two files is an error naming both.
Status SortTensors(const std::string& dir, Metadata& m) {
  std::stable_sort(m.tensors.begin(), m.tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) { return a.key < b.key; });
  for (size_t i = 1; i < m.tensors.size(); ++i) {
    if (m.tensors[i].key == m.tensors[i - 1].key) {
      const auto& files = m.files;
      return DataLoss("tensor '" + m.tensors[i].key + "' is in two safetensors files of " + dir +
                      ": " + files[m.tensors[i - 1].chunks[0].location.file_index].name + " and " +
                      files[m.tensors[i].chunks[0].location.file_index].name);
    }
  }
  return Status::Ok();
}

Metadata EmptyMetadata() {
  Metadata m;
  m.format = CheckpointFormat::kSafetensors;
  m.checksum = ChecksumKind::kNone;
  m.save_id = "safetensors";
  return m;
}

// The weight map of an index JSON: file name -> tensor names. Errors name the index file.
Result<std::map<std::string, std::set<std::string>>> ReadWeightMap(Storage& storage,
                                                                   const std::string& dir,
                                                                   Metadata& m) {
  const std::string path = JoinPath(dir, kHuggingFaceIndexName);
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  if (file->size() > kMaxIndexBytes) {
    return DataLoss(path + " is " + std::to_string(file->size()) + " bytes, more than the " +
                    std::to_string(kMaxIndexBytes) + " an index may have");
  }
  std::string text(file->size(), '\0');
  TESSERA_RETURN_IF_ERROR(file->ReadAt(0, text.data(), text.size()));
  TESSERA_ASSIGN_OR_RETURN(const nlohmann::json doc, ParseBoundedJson(text, path));
  if (!doc.is_object()) return DataLoss(path + " is not a JSON object");
  const auto weight_map = doc.find("weight_map");
  if (weight_map == doc.end() || !weight_map->is_object()) {
    return DataLoss(path + " has no \"weight_map\" object");
  }
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [tensor, where] : weight_map->items()) {
    if (!where.is_string()) {
      return DataLoss(path + ": weight_map[\"" + tensor + "\"] is not a file name string");
    }
    const std::string& name = where.get_ref<const std::string&>();
    if (Status s = CheckDataFileName(name); !s.ok()) {
      return DataLoss(path + ": weight_map[\"" + tensor + "\"]: " + s.message());
    }
    by_file[name].insert(tensor);
  }
  if (const auto meta = doc.find("metadata"); meta != doc.end() && meta->is_object()) {
    for (const auto& [k, v] : meta->items()) {
      m.user_metadata[k] = v.is_string() ? v.get_ref<const std::string&>() : v.dump();
    }
  }
  return by_file;
}

// A shard name "<prefix>-<i>-of-<n>.safetensors", its numbers of 5 to 9 digits (huggingface_hub
// writes 5).
struct ShardName {
  std::string prefix;
  std::string count;  // <n> as spelt
  uint64_t index = 0, total = 0;
  // The name of shard `i` of the same set, its number spelt as wide as <n>.
  std::string Sibling(uint64_t i) const {
    std::string number = std::to_string(i);
    if (number.size() < count.size()) number.insert(0, count.size() - number.size(), '0');
    return prefix + "-" + number + "-of-" + count + kSuffix;
  }
};

bool ParseDigits(std::string_view digits, uint64_t* out) {
  if (digits.size() < 5 || digits.size() > 9) return false;
  *out = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
    *out = *out * 10 + static_cast<uint64_t>(c - '0');
  }
  return true;
}

std::optional<ShardName> ParseShardName(std::string_view name) {
  if (!name.ends_with(kSuffix)) return std::nullopt;
  name.remove_suffix(sizeof(kSuffix) - 1);
  const size_t of = name.rfind("-of-");
  if (of == std::string_view::npos || of == 0) return std::nullopt;
  const size_t dash = name.rfind('-', of - 1);
  if (dash == std::string_view::npos) return std::nullopt;
  ShardName shard{std::string(name.substr(0, dash)), std::string(name.substr(of + 4))};
  if (!ParseDigits(name.substr(dash + 1, of - dash - 1), &shard.index) ||
      !ParseDigits(shard.count, &shard.total)) {
    return std::nullopt;
  }
  return shard;
}

// Without an index, the shards of a set "<prefix>-<i>-of-<n>.safetensors" among `names` must
// all be there: a set with one missing is a copy or a conversion that has not finished (a
// conversion renames every shard into place before it publishes the index), and reading the
// shards present would load a checkpoint without some of its tensors. DataLoss naming the first
// missing shard.
Status CheckShardSetsComplete(const std::string& dir, const std::vector<std::string>& names) {
  std::map<std::pair<std::string, std::string>, std::pair<ShardName, std::set<uint64_t>>> sets;
  for (const std::string& name : names) {
    std::optional<ShardName> shard = ParseShardName(name);
    if (!shard) continue;
    auto [it, added] =
        sets.try_emplace({shard->prefix, shard->count}, *shard, std::set<uint64_t>());
    it->second.second.insert(shard->index);
  }
  for (const auto& [key, set] : sets) {
    const auto& [shard, present] = set;
    for (uint64_t i = 1; i <= shard.total; ++i) {
      if (present.count(i)) continue;
      return DataLoss("safetensors shard " + JoinPath(dir, shard.Sibling(i)) + " is missing (" +
                      shard.Sibling(shard.index) + " is there, and no " + kHuggingFaceIndexName +
                      " says which tensors the shards hold): an unfinished copy or conversion?");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Metadata> ReadHuggingFaceDirectory(Storage& storage, const std::string& dir,
                                          const std::vector<std::string>& names) {
  Metadata m = EmptyMetadata();
  if (std::find(names.begin(), names.end(), kHuggingFaceIndexName) != names.end()) {
    TESSERA_ASSIGN_OR_RETURN(auto by_file, ReadWeightMap(storage, dir, m));
    for (const auto& [file, tensors] : by_file) {
      TESSERA_RETURN_IF_ERROR(AddFile(storage, dir, file, &tensors, m));
    }
  } else {
    TESSERA_RETURN_IF_ERROR(CheckShardSetsComplete(dir, names));
    for (const std::string& name : names) {
      if (!name.ends_with(kSuffix)) continue;
      TESSERA_RETURN_IF_ERROR(AddFile(storage, dir, name, nullptr, m));
    }
  }
  TESSERA_RETURN_IF_ERROR(SortTensors(dir, m));
  return m;
}

Result<Metadata> ReadHuggingFaceFile(Storage& storage, const std::string& dir,
                                     const std::string& file_name) {
  Metadata m = EmptyMetadata();
  TESSERA_RETURN_IF_ERROR(AddFile(storage, dir, file_name, nullptr, m));
  TESSERA_RETURN_IF_ERROR(SortTensors(dir, m));
  return m;
}

}  // namespace tessera
