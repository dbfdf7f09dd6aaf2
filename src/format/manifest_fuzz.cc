// libFuzzer target: the manifest decoder must turn any bytes into a Metadata that passes its
// own validity rules, or into an error; never crash, hang or allocate without bound.
// Corpus: fuzz/corpus/manifest/. Run: scripts/fuzz manifest.
#include <cstddef>
#include <cstdint>
#include <span>

#include "format/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tessera::Result<tessera::Metadata> metadata =
      tessera::DecodeManifest(std::span<const uint8_t>(data, size), "fuzz");
  if (metadata.ok()) {
    // What decodes must encode and decode to the same thing.
    tessera::Bytes again = tessera::EncodeManifest(*metadata);
    tessera::Result<tessera::Metadata> round = tessera::DecodeManifest(again, "fuzz-again");
    if (!round.ok() || !(round->tensors == metadata->tensors)) __builtin_trap();
  }
  return 0;
}
