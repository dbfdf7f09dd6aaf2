// libFuzzer target: the strict safetensors header reader (the data files of tessera
// checkpoints and Hugging Face weights) takes any file and returns a header or an error.
// Corpus: fuzz/corpus/safetensors/. Run: scripts/fuzz safetensors.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "format/safetensors.h"
#include "tessera/memory_storage.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tessera::MemoryStorage storage;
  storage.SetFileContents("/f.safetensors", std::vector<uint8_t>(data, data + size));
  auto file = storage.NewReadableFile("/f.safetensors");
  if (!file.ok()) __builtin_trap();
  tessera::Result<tessera::SafetensorsHeader> header = tessera::ReadSafetensorsHeader(**file);
  if (header.ok()) {
    for (const tessera::SafetensorsEntry& e : header->entries) {
      if (e.end < e.begin || header->data_start + e.end > size) __builtin_trap();
    }
  }
  return 0;
}
