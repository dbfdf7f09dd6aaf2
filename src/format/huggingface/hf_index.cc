#include "format/huggingface/hf_index.h"

#include <algorithm>
#include <map>
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
