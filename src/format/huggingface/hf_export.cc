#include "format/huggingface/hf_export.h"

#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/utf8.h"

namespace tessera {

std::string HuggingFaceShardName(int index, int count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", index + 1, count);
  return name;
}

Result<std::string> EncodeHuggingFaceIndex(
    uint64_t total_size, const std::vector<std::pair<std::string, std::string>>& weight_map) {
  nlohmann::json map = nlohmann::json::object();
  for (const auto& [name, file] : weight_map) {
    if (!IsValidUtf8(name)) {
      return InvalidArgument("tensor name " + QuoteBytes(name) +
                             " is not valid UTF-8 and cannot be written to a JSON index");
    }
    map[name] = file;
  }
  nlohmann::json doc = {{"metadata", {{"total_size", total_size}}}, {"weight_map", map}};
  return doc.dump(2) + "\n";
}

}  // namespace tessera
