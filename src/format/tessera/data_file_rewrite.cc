#include "format/tessera/data_file_rewrite.h"

#include <map>
#include <set>

#include "format/safetensors.h"

namespace tessera {

Result<RewrittenDataFile> RewriteDataFileLayout(const ReadableFile& old_file,
                                                const std::vector<KeptItem>& kept,
                                                const std::string& save_id) {
  TESSERA_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(old_file));
  std::multimap<uint64_t, const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : header.entries) {
    by_offset.emplace(header.data_start + e.begin, &e);
  }
  std::set<const SafetensorsEntry*> used;
  std::vector<SafetensorsEntry> entries;
  for (const KeptItem& item : kept) {
    const SafetensorsEntry* found = nullptr;
    auto [begin, end] = by_offset.equal_range(item.offset);
    for (auto it = begin; it != end && !found; ++it) {  // zero-byte entries share offsets
      const SafetensorsEntry& e = *it->second;
      if (!used.count(&e) && e.end - e.begin == item.length && e.dtype == item.dtype &&
          e.shape == item.shape) {
        found = &e;
      }
    }
    if (!found) {
      return DataLoss("the safetensors header of " + old_file.path() + " does not describe " +
                      item.what + " at offset " + std::to_string(item.offset) +
                      " as the manifest does");
    }
    used.insert(found);
    entries.push_back(*found);
  }
  const uint64_t data_bytes = LayOutEntries(entries);
  std::map<std::string, std::string> header_metadata = header.metadata;
  header_metadata["tessera_save_id"] = save_id;
  RewrittenDataFile out;
  TESSERA_ASSIGN_OR_RETURN(out.header, EncodeSafetensorsHeader(entries, header_metadata));
  for (const SafetensorsEntry& e : entries) out.offsets.push_back(out.header.size() + e.begin);
  out.size = out.header.size() + data_bytes;
  return out;
}

}  // namespace tessera
