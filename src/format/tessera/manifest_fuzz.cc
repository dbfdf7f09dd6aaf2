// libFuzzer target: the manifest decoder must turn any bytes into a Metadata that passes its
// own validity rules, or into an error; never crash, hang or allocate without bound.
// Corpus: fuzz/corpus/manifest/. Run: scripts/fuzz manifest.
//
// Input: one mode byte, then the manifest. Most mutations of a manifest break its checksum,
// and the decoder rejects those before it looks at the body; with bit 0 of the mode byte set
// the target first repairs the header (magic, flags 0, body length = what follows; the version
// kept when it is one this build reads, else 1) and the trailing checksum, so that mutations
// reach the body decoder of either version. Bit 0 clear: the bytes are decoded as they are (the
// header checks themselves). Seeds cover every version and every manifest kind (a whole
// checkpoint; a rank's part of a rank-local save: v2_rank_part*; version 3's commit numbers and
// references: v3_*, and a part claiming 2^31-1 ranks, issue 22 defect 8). Bit 1 also decodes
// the input as the index carried between ranks (EncodeCarriedIndex), its format byte the mode
// byte's bits 2-7 (carried_* seeds).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "core/checksum.h"
#include "core/utf8.h"
#include "format/tessera/manifest.h"

namespace {

void RepairHeaderAndChecksum(std::vector<uint8_t>& m) {
  const uint64_t fixed = tessera::kManifestHeaderBytes + tessera::kManifestTrailerBytes;
  if (m.size() < fixed) m.resize(fixed, 0);
  // A version 2 body must reach its own decoder, not be read as version 1.
  uint32_t version = 0;
  std::memcpy(&version, m.data() + 8, 4);
  if (version < 1 || version > tessera::kFormatVersion) version = 1;
  const uint32_t flags = 0;
  const uint64_t body = m.size() - fixed;
  std::memcpy(m.data(), "TSRMANIF", 8);
  std::memcpy(m.data() + 8, &version, 4);
  std::memcpy(m.data() + 12, &flags, 4);
  std::memcpy(m.data() + 16, &body, 8);
  const uint64_t checksum = tessera::Checksum(m.data(), m.size() - 8);
  std::memcpy(m.data() + m.size() - 8, &checksum, 8);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::vector<uint8_t> manifest(data + 1, data + size);
  if (data[0] & 1) RepairHeaderAndChecksum(manifest);
  tessera::Result<uint64_t> header =
      tessera::CheckManifestHeader(manifest, manifest.size(), "fuzz");
  tessera::Result<tessera::Metadata> metadata = tessera::DecodeManifest(manifest, "fuzz");
  // The header check a reader makes before reading the rest never accepts what the decoder
  // rejects for the same reason, and accepts everything the decoder accepts.
  if (metadata.ok() && !header.ok()) __builtin_trap();
  if (metadata.ok()) {
    // What decodes must encode and decode to the same thing.
    tessera::Bytes again = tessera::EncodeManifest(*metadata);
    tessera::Result<tessera::Metadata> round = tessera::DecodeManifest(again, "fuzz-again");
    if (!round.ok()) __builtin_trap();
    round->format_version = metadata->format_version;  // a version 1 input comes back as 2
    if (!(*round == *metadata)) __builtin_trap();
    // Any bytes the decoder accepts can be described (inspect, Python): never a crash.
    tessera::CheckMetadataIsUtf8(*metadata, "fuzz").IgnoreError();
    for (const tessera::TensorInfo& t : metadata->tensors) {
      for (const tessera::ChunkInfo& c : t.chunks) (void)c.box.ToString();
    }
  }
  // Bit 1: the same bytes as the index tessera carries between ranks (EncodeCarriedIndex: one
  // byte naming the format, then a manifest): it decodes exactly when the manifest does, keeps
  // the format byte as it came, and encodes back to what it decoded.
  if (data[0] & 2) {
    std::vector<uint8_t> carried;
    carried.reserve(1 + manifest.size());
    carried.push_back(static_cast<uint8_t>(data[0] >> 2));
    carried.insert(carried.end(), manifest.begin(), manifest.end());
    tessera::Result<tessera::Metadata> index = tessera::DecodeCarriedIndex(carried, "fuzz");
    if (index.ok() != metadata.ok()) __builtin_trap();
    if (index.ok()) {
      if (static_cast<uint8_t>(index->format) != carried[0]) __builtin_trap();
      tessera::Result<tessera::Metadata> back =
          tessera::DecodeCarriedIndex(tessera::EncodeCarriedIndex(*index), "fuzz-again");
      if (!back.ok()) __builtin_trap();
      back->format_version = index->format_version;
      if (!(*back == *index)) __builtin_trap();
    }
  }
  return 0;
}
