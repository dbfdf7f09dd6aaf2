// libFuzzer target: reading a raw_dir checkpoint (the test-only fourth format,
// raw_dir_format.h) takes any index bytes and returns a valid index or an error naming the
// index; never crashes, hangs or allocates without bound. raw_dir is no part of the library,
// but its index parser is the model a new format copies, so it is held to what every reader
// of other people's bytes is. Corpus: fuzz/corpus/raw_dir_index/. Run: scripts/fuzz
// raw_dir_index.
//
// Input: one mode byte, then the bytes. Mode bit 0 set: the bytes are the "index" value, and
// the target wraps them in the envelope with their correct XXH3 ({"xxh3":"...","index":<bytes>}),
// so that the fuzzer reaches the JSON fields past the checksum; clear: the bytes are the whole
// index file. The directory also holds one data file, raw_dir-s-r0-f0.bin, of 16 bytes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/checksum.h"
#include "core/hex.h"
#include "format/checkpoint_index.h"
#include "format/registry.h"
#include "format/testing/raw_dir_format.h"
#include "tessera/memory_storage.h"

namespace {

constexpr char kDir[] = "/raw";

std::vector<uint8_t> Wrapped(const uint8_t* body, size_t size) {
  const std::string head =
      "{\"xxh3\":\"" + tessera::Hex64(tessera::Checksum(body, size)) + "\",\"index\":";
  std::vector<uint8_t> file(head.begin(), head.end());
  file.insert(file.end(), body, body + size);
  file.push_back('}');
  return file;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Registered for the whole run, as a test registers it for a case.
  static tessera::ScopedFormatRegistration registration(tessera::testing::RawDirFormat());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool wrap = data[0] & 1;
  tessera::MemoryStorage storage;
  storage.SetFileContents(
      std::string(kDir) + "/" + tessera::testing::kRawDirIndexName,
      wrap ? Wrapped(data + 1, size - 1) : std::vector<uint8_t>(data + 1, data + size));
  storage.SetFileContents(std::string(kDir) + "/raw_dir-s-r0-f0.bin", std::vector<uint8_t>(16));
  tessera::Result<tessera::CheckpointIndex> index = tessera::ReadCheckpointIndex(storage, kDir);
  if (!index.ok()) {
    // Every refusal names the index it refused.
    if (index.status().message().find(tessera::testing::kRawDirIndexName) == std::string::npos) {
      __builtin_trap();
    }
    return 0;
  }
  // What a load relies on: keys sorted and unique, every item inside a listed file, exactly
  // one item per file and the whole of it (raw_dir's own rule).
  const tessera::Metadata& m = index->metadata;
  std::vector<int> items(m.files.size(), 0);
  auto place = [&](const tessera::ByteLocation& at) {
    if (at.file_index >= m.files.size() || at.offset != 0 ||
        at.length != m.files[at.file_index].size || ++items[at.file_index] > 1) {
      __builtin_trap();
    }
  };
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    if (t > 0 && !(m.tensors[t - 1].key < m.tensors[t].key)) __builtin_trap();
    for (const tessera::ChunkInfo& c : m.tensors[t].chunks) place(c.location);
  }
  for (const tessera::ObjectInfo& o : m.objects) place(o.location);
  for (int n : items) {
    if (n != 1) __builtin_trap();
  }
  return 0;
}
