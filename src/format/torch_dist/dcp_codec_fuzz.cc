// libFuzzer target: the DCP codec (dcp_codec.h) on foreign bytes. The first byte chooses:
//   0: the rest is a .metadata; what reads turns into Metadata (every data file 1 MiB) whose
//      every location lies inside its file, and which the manifest encoding carries unchanged;
//   1: the rest is one tensor item; resolving a chunk of the dtype and shape the item claims
//      gives raw bytes inside the item and, when permuted, a permutation of its dimensions.
// Corpus: fuzz/corpus/dcp_codec/. Run: scripts/fuzz dcp_codec.
#include <cstddef>
#include <cstdint>
#include <span>

#include "format/tessera/manifest.h"
#include "format/torch_dist/dcp_codec.h"
#include "format/torch_dist/torch_dtype.h"
#include "tessera/memory_storage.h"

namespace {

using namespace tessera;  // NOLINT: a fuzz target's one function

void FuzzMetadata(std::span<const uint8_t> bytes) {
  auto dcp = torch_dist::ReadDcpMetadata(bytes, "fuzz/.metadata");
  if (!dcp.ok()) return;
  std::map<std::string, uint64_t> sizes;
  for (const torch_dist::DcpStorage& s : dcp->storage) sizes[s.relative_path] = 1u << 20;
  auto m = torch_dist::DcpToMetadata(*dcp, sizes, "fuzz/.metadata", bytes.size());
  if (!m.ok()) return;
  for (const TensorInfo& t : m->tensors) {
    for (const ChunkInfo& c : t.chunks) {
      const ByteLocation& l = c.location;
      if (l.file_index >= m->files.size() || l.length > m->files[l.file_index].size ||
          l.offset > m->files[l.file_index].size - l.length) {
        __builtin_trap();
      }
    }
  }
  // A name that is no plain file name, overlapping chunks, ...: the check's business.
  auto decoded = DecodeManifest(EncodeManifest(*m), "fuzz");
  if (decoded.ok() && !(decoded->tensors == m->tensors && decoded->objects == m->objects)) {
    __builtin_trap();
  }
}

void FuzzItem(std::span<const uint8_t> bytes) {
  auto item = torch_dist::ParseTorchTensorItem(bytes, "fuzz.item");
  if (!item.ok()) return;
  auto dtype = torch_dist::DTypeFromTorchName(item->torch_dtype);
  if (!dtype.ok()) return;
  MemoryStorage storage;
  {
    auto file = storage.NewWritableFile("item");
    if (!file.ok() || !(*file)->WriteAt(0, bytes.data(), bytes.size()).ok()) __builtin_trap();
    if (!(*file)->Close().ok()) __builtin_trap();
  }
  auto file = storage.NewReadableFile("item");
  if (!file.ok()) __builtin_trap();
  TensorInfo tensor;
  tensor.key = "k";
  tensor.dtype = *dtype;
  tensor.global_shape = item->size;
  ChunkInfo chunk;
  chunk.box = Box::Whole(item->size);
  chunk.location = ByteLocation{0, 0, bytes.size(), 0};
  chunk.encoding = ChunkEncoding::kTorchSaveItem;
  if (!torch_dist::ResolveTorchSaveChunk(**file, tensor, chunk).ok()) return;
  const ByteLocation& l = chunk.location;
  if (chunk.encoding != ChunkEncoding::kRaw || l.length > bytes.size() ||
      l.offset > bytes.size() - l.length ||
      l.length != static_cast<uint64_t>(chunk.box.NumElements()) * DTypeSize(*dtype)) {
    __builtin_trap();
  }
  std::vector<bool> seen(chunk.storage_order.size(), false);
  for (uint8_t d : chunk.storage_order) {
    if (d >= seen.size() || seen[d]) __builtin_trap();
    seen[d] = true;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::span<const uint8_t> rest(data + 1, size - 1);
  if (data[0] == 0) FuzzMetadata(rest);
  if (data[0] == 1) FuzzItem(rest);
  return 0;
}
