// Reading PyTorch DCP / Megatron-Core torch_dist directories as tessera Metadata
// (docs/FORMAT_TORCH_DIST.md, "What tessera reads").
//
// The index: `.metadata` (a pickle, read by ReadDcpMetadata without importing anything) becomes
// a Metadata of format kTorchDist without checksums. Every tensor chunk is one DCP item, a whole
// torch.save zip archive: its ChunkInfo has encoding kTorchSaveItem and the item's (file,
// offset, length) as its location. Where the raw elements lie inside the item (the zip's stored
// record `<archive>/data/<n>`, the storage offset and strides of data.pkl) is not read here:
// ResolveTorchSaveChunks does it later, for the chunks a load touches only, by reading the
// item's zip directory and data.pkl (its first and last 4 KiB), never the tensor's bytes.
//
// Objects: every BytesStorageMetadata entry is an object whose bytes are the whole item
// (ObjectEncoding::kTorchSave: torch.load gives the value back). Megatron-Core's
// `metadata.json` and `common.pt`, when present, are the objects "metadata.json" (kJson) and
// "common.pt" (kTorchSave), the whole file each. Megatron ShardedObject keys
// (`key/shard_<offsets>_<shape>`) stay as they are.
//
// Thread safety: pure functions over the Storage they are given.
#ifndef TESSERA_FORMAT_TORCH_DIST_DCP_CODEC_H_
#define TESSERA_FORMAT_TORCH_DIST_DCP_CODEC_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "format/torch_dist/dcp_metadata.h"
#include "format/torch_dist/torch_zip.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera::torch_dist {

// Megatron-Core's files beside a DCP checkpoint, exposed as objects of these keys.
inline constexpr char kMegatronMetadataJson[] = "metadata.json";
inline constexpr char kMegatronCommon[] = "common.pt";

// Megatron-Core's N-D reformulated flattened tensors (mcore_data[key]
// ["nd_reformulated_orig_global_shape"]) are exposed as the original tensors: each DCP chunk,
// a flat range of one fragment, becomes the boxes of the original tensor it covers (chunks
// with a payload_offset into the same item). Their keys are listed in this user_metadata entry
// (a JSON array), so the resolution (on any rank) knows their items are flat runs.
inline constexpr char kNdReformulatedKeys[] = "torch_dist.nd_reformulated";
// user_metadata key: planner_data's path of each key in the saved nested state dict (torch
// 2.x's flatten_state_dict), a JSON object {fqn: [str key or int index, ...]}; present only
// when some path is not (fqn,). tessera.load_all rebuilds the nesting from it as torch's
// unflatten_state_dict does.
inline constexpr char kPlannerPathsKey[] = "torch_dist.planner_paths";
// The keys that entry lists.
std::set<std::string> NdReformulatedKeys(const Metadata& metadata);

// A `.metadata` larger than this is refused before it is read (a 1M-chunk one is ~100 MB).
inline constexpr uint64_t kMaxDcpMetadataBytes = uint64_t{4} << 30;

// Turns a parsed .metadata into Metadata. `file_sizes` maps every data file the .metadata
// names to its size in bytes (a file missing from it is an error naming it). `source` (the
// .metadata's path) prefixes errors (kDataLoss): a dtype tessera lacks (complex), an item
// outside its file, a chunk whose item is too small for its elements, and a Metadata that would
// take more than DcpExpansionBudget(metadata_bytes) bytes (`metadata_bytes`: the size of the
// .metadata; an N-D reformulated chunk becomes up to 2N-1 boxes). Tensors and objects come out
// sorted by key; no I/O.
Result<Metadata> DcpToMetadata(const DcpMetadata& dcp,
                               const std::map<std::string, uint64_t>& file_sizes,
                               const std::string& source, uint64_t metadata_bytes);

// Reads the DCP checkpoint in `dir` (whose sorted listing is `names`; it holds `.metadata`):
// the .metadata, the size of every data file it names, Megatron's metadata.json and common.pt
// when present. Errors name the file: a .metadata that is not a DCP pickle (and the offset of
// what is wrong in it), a data file that is missing.
Result<Metadata> ReadDcpDirectory(Storage& storage, const std::string& dir,
                                  const std::vector<std::string>& names);

// Resolves one kTorchSaveItem chunk of `tensor` whose item lies in `file` (already open):
// reads the item's zip directory and data.pkl and turns the chunk into a kRaw chunk whose
// location is the bytes of its elements, with a storage_order when the item is a permuted
// view (a saved transposed tensor). Errors name the key, the file and the item's offset: a
// damaged item (kDataLoss), an item of another dtype or shape than the .metadata says
// (kDataLoss), strides that are no permutation of a row-major block (kUnimplemented).
// `flattened`: the tensor is one of NdReformulatedKeys; its items are flat runs of elements
// and the chunk's box is the run of them payload_offset bytes in (no shape check).
Status ResolveTorchSaveChunk(const ReadableFile& file, const TensorInfo& tensor, ChunkInfo& chunk,
                             bool flattened = false, ItemReadStats* stats = nullptr);

// (tensor index, chunk index) into Metadata::tensors.
using ChunkRef = std::pair<uint32_t, uint32_t>;

// Resolves the listed chunks of `metadata` (those not kTorchSaveItem are left alone), files
// under `root`, with up to `num_threads` threads; each data file is opened once. Adds what it
// read to `stats`. On errors, the first one (by file index) is returned.
Status ResolveTorchSaveChunks(Storage& storage, const std::string& root, Metadata& metadata,
                              const std::vector<ChunkRef>& chunks, int num_threads,
                              ItemReadStats* stats = nullptr);

// True when some chunk of `metadata` is still a kTorchSaveItem.
bool HasTorchSaveChunks(const Metadata& metadata);

}  // namespace tessera::torch_dist

#endif  // TESSERA_FORMAT_TORCH_DIST_DCP_CODEC_H_
