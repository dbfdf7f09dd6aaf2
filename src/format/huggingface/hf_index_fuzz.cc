// libFuzzer target: reading a Hugging Face checkpoint directory (ReadCheckpointIndex over
// model.safetensors.index.json and the shards it names, or over the shards alone) takes any
// bytes and returns a valid index or an error; never crashes, hangs or allocates without
// bound. Corpus: fuzz/corpus/hf_index/. Run: scripts/fuzz hf_index.
//
// Input: one mode byte, then up to three parts separated by kSeparator: the index JSON, the
// first shard, the second shard. Mode bit 0 set: the directory holds the index and both shards
// (model-00001-of-00002.safetensors, model-00002-of-00002.safetensors); clear: only the
// shards, read without an index (which must then be a complete set: bit 1 set drops the second
// shard). The safetensors header parser has its own target
// (safetensors); this one reaches the index JSON reader and the matching of its weight map
// against the shards' headers.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "format/checkpoint_index.h"
#include "tessera/memory_storage.h"

namespace {

constexpr std::string_view kSeparator = "\xff\xfe--8<--\xfe\xff";

std::vector<std::vector<uint8_t>> Split(const uint8_t* data, size_t size) {
  std::vector<std::vector<uint8_t>> parts;
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  size_t begin = 0;
  while (parts.size() < 2) {
    const size_t at = all.find(kSeparator, begin);
    if (at == std::string_view::npos) break;
    parts.emplace_back(data + begin, data + at);
    begin = at + kSeparator.size();
  }
  parts.emplace_back(data + begin, data + size);
  parts.resize(3);
  return parts;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool with_index = data[0] & 1;
  std::vector<std::vector<uint8_t>> parts = Split(data + 1, size - 1);
  tessera::MemoryStorage storage;
  if (with_index) storage.SetFileContents("/hf/model.safetensors.index.json", parts[0]);
  storage.SetFileContents("/hf/model-00001-of-00002.safetensors", parts[1]);
  // Mode bit 1 set: the second shard is missing (a copy that stopped, or a conversion between
  // the renames of its shards); without the index, the set is then incomplete and refused.
  const bool second_missing = data[0] & 2;
  if (!second_missing) storage.SetFileContents("/hf/model-00002-of-00002.safetensors", parts[2]);
  tessera::Result<tessera::CheckpointIndex> index = tessera::ReadCheckpointIndex(storage, "/hf");
  if (!with_index && second_missing && index.ok()) __builtin_trap();
  if (!index.ok()) return 0;
  // What a load relies on: every chunk lies inside a file of the directory, of the recorded
  // size, and keys are sorted and unique.
  const tessera::Metadata& m = index->metadata;
  for (const tessera::FileInfo& f : m.files) {
    auto file = storage.NewReadableFile("/hf/" + f.name);
    if (!file.ok() || (*file)->size() != f.size) __builtin_trap();
  }
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    if (t > 0 && !(m.tensors[t - 1].key < m.tensors[t].key)) __builtin_trap();
    for (const tessera::ChunkInfo& c : m.tensors[t].chunks) {
      const tessera::ByteLocation& at = c.location;
      if (at.file_index >= m.files.size()) __builtin_trap();
      if (at.offset > m.files[at.file_index].size ||
          at.length > m.files[at.file_index].size - at.offset) {
        __builtin_trap();
      }
    }
  }
  return 0;
}
