// Writing PyTorch DCP checkpoints (docs/FORMAT_TORCH_DIST.md, "What tessera writes"): the
// names of the files tessera writes into a DCP directory, the streaming of one item into a data
// file, and the `.metadata` of a checkpoint described by tessera's Metadata.
//
// Used by Save with SaveFormat::kTorchDist through this format's FormatWriter
// (dcp_format_writer.h), and by Convert: the write engine streams each item with
// TorchTensorItemWriter / WriteDcpObjectItem into files named DcpDataFileName, the commit marks
// what was written (MarkDcpItems) and encodes it as the `.metadata` (ToDcpMetadata).
//
// Thread safety: pure functions; a TorchTensorItemWriter is used by one thread at a time.
#ifndef TESSERA_FORMAT_TORCH_DIST_DCP_WRITER_H_
#define TESSERA_FORMAT_TORCH_DIST_DCP_WRITER_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/crc32.h"
#include "format/torch_dist/dcp_metadata.h"
#include "format/torch_dist/torch_zip.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera::torch_dist {

// ---- file names -------------------------------------------------------------------------------

inline constexpr char kDcpMetadataFileName[] = ".metadata";

// "__<rank>_<file_index>.tsr-<save_id>.distcp". torch's own names are "__<rank>_<n>.distcp";
// torch reads any name (_StorageInfo.relative_path). The save id keeps a save from ever
// overwriting a file of the checkpoint it replaces (so a crash leaves the old one readable) and
// tells tessera's cleanup which files it wrote: it never removes a file without one (torch's).
std::string DcpDataFileName(std::string_view save_id, int rank, int file_index);
// The save id of a name DcpDataFileName produces; "" for any other name.
std::string DcpDataFileSaveId(std::string_view name);
// The name the `.metadata` of save `save_id` is written under before its atomic rename:
// ".metadata.tsr-<save_id>.tmp".
std::string TempDcpMetadataName(std::string_view save_id);
// The save id of a name TempDcpMetadataName produces; "" for any other name.
std::string TempDcpMetadataSaveId(std::string_view name);

// ---- items ------------------------------------------------------------------------------------

// Streams one tensor item (torch.save of a contiguous tensor, byte for byte as torch 1.13
// writes it) into `file` at `offset`: Begin writes the prefix, Append the data in pieces of any
// size (computing the zip CRC-32 as it goes), Finish the suffix.
class TorchTensorItemWriter {
 public:
  // Lays the item out and writes its prefix. InvalidArgument for a dtype FindTorchDType does
  // not know or a negative dimension; the file's errors.
  static Result<TorchTensorItemWriter> Begin(WritableFile& file, uint64_t offset,
                                             const TorchTensorSpec& spec);
  // Writes the next `n` bytes of the tensor's elements (row-major, little-endian).
  // InvalidArgument when they would pass layout().data_size.
  Status Append(const void* data, size_t n);
  // Writes the suffix once every data byte was appended (FailedPrecondition otherwise).
  // Returns the item's length, layout().total_size.
  Result<uint64_t> Finish();

  const TorchItemLayout& layout() const { return layout_; }
  // The file offset just past the bytes written so far.
  uint64_t position() const { return offset_ + layout_.data_offset + crc_.length(); }

 private:
  TorchTensorItemWriter(WritableFile& file, uint64_t offset, TorchItemLayout layout)
      : file_(&file), offset_(offset), layout_(std::move(layout)) {}
  WritableFile* file_;
  uint64_t offset_;
  TorchItemLayout layout_;
  Crc32Stream crc_;
};

// The byte item of an object of `encoding`, as torch.load gives back the value it stands for:
//   kPickle      a torch.save archive whose data.pkl is `data` (torch.load unpickles it)
//   kTorchSave   `data` itself (already a torch.save archive)
//   kBytes, kJson  torch.save(bytes(data)) (torch.load gives the bytes)
// Writes that item into `file` at `offset`; returns its length. The archive forms are built in
// memory first (objects are small; a kTorchSave object is written as it is).
Result<uint64_t> WriteDcpObjectItem(WritableFile& file, uint64_t offset,
                                    std::span<const uint8_t> data, ObjectEncoding encoding);

// ---- the index --------------------------------------------------------------------------------

// Whether torch 1.13 has the dtype (it lacks float8 and uint16/32/64, which torch 2.x saves
// over an untyped storage).
bool Torch113HasDType(DType dtype);

// Turns a Metadata whose chunks and objects were written as DCP items (their locations are the
// whole items) into what Metadata says about such a checkpoint: format kTorchDist, no
// checksums, every chunk ChunkEncoding::kTorchSaveItem (payload 0, row-major), every object
// ObjectEncoding::kTorchSave (what torch.load reads), block checksums cleared.
void MarkDcpItems(Metadata& metadata);

struct DcpIndexOptions {
  DcpFlavor flavor = DcpFlavor::kTorch2;
  // torch 2.x only: StorageMeta.checkpoint_id (torch writes the directory; nothing reads it).
  // Empty: none.
  std::string checkpoint_id;
  // torch 2.x only: planner_data's path of each key; a key not listed gets (key,). Not owned;
  // null: every key (key,).
  // (DcpPathElement is SaveOptions' TorchDistPathElement.)
  const std::map<std::string, std::vector<DcpPathElement>>* key_paths = nullptr;
};

// The `.metadata` content of `metadata` (as MarkDcpItems leaves it; Metadata::files name the
// data files): state_dict_metadata in key order (tensors, then objects), storage_data with the
// chunk index as MetadataIndex.index, and for kTorch2 planner_data {fqn: path} (the path of
// options.key_paths, else (fqn,): what torch 2.x writes for a flat state dict), storage_meta
// (checkpoint_id, save_id) and version "1.0.0". InvalidArgument naming the key for a chunk that is
// not a whole tensor item, a dtype without a torch counterpart, or (kTorch113) one torch 1.13
// lacks.
Result<DcpMetadata> ToDcpMetadata(const Metadata& metadata, const DcpIndexOptions& options);

}  // namespace tessera::torch_dist

#endif  // TESSERA_FORMAT_TORCH_DIST_DCP_WRITER_H_
