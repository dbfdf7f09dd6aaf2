// The items of a PyTorch DCP data file (docs/FORMAT_TORCH_DIST.md, "Items"): each tensor is
// the whole output of `torch.save(tensor)`, a zip archive whose offsets are relative to the
// item's first byte; each object is `torch.save(obj)` (or, from some writers, raw bytes).
//
// Reading locates a tensor's raw bytes inside its item without reading them: the codec asks
// for the item's last 4 KiB (end records and central directory) and first 4 KiB (data.pkl and
// the data record's local header) -- one read when the item is at most 8 KiB -- and only an
// unusual archive needs a third read. Every offset is checked against the item's length.
//
// Writing produces the bytes torch 1.13's torch.save writes for the same tensor, byte for
// byte: records `<archive>/data.pkl`, `<archive>/data/0`, `<archive>/version` ("3\n"), stored,
// each record's data 64-byte aligned by an "FB" extra field, data descriptors, central
// directory, ZIP64 end record and locator, classic end record. The item is laid out before
// its data is known (prefix, data, suffix), so a writer can stream the data, CRC it as it
// goes (Crc32Stream), and write the suffix last.
//
// Thread safety: pure functions and values.
#ifndef TESSERA_FORMAT_TORCH_DIST_TORCH_ZIP_H_
#define TESSERA_FORMAT_TORCH_DIST_TORCH_ZIP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera::torch_dist {

// ---- reading ----------------------------------------------------------------------------------

// Reads exactly `n` bytes at `offset` (relative to the item's first byte) into `dst`. The
// reader never asks for bytes outside [0, item_length).
using ItemReadFn = std::function<Status(uint64_t offset, void* dst, size_t n)>;

// The reader's first requests: the item's first and last kItemProbeBytes (one range when they
// overlap or touch). A caller doing its own I/O can fetch these ahead and serve them from memory.
inline constexpr uint64_t kItemProbeBytes = 4096;
std::vector<std::pair<uint64_t, uint64_t>> ItemProbeRanges(uint64_t item_length);  // offset, size

// What a read cost: calls of the ItemReadFn and bytes read.
struct ItemReadStats {
  int reads = 0;
  uint64_t bytes = 0;
};

// One record of the archive's central directory.
struct ZipRecord {
  std::string name;  // full name, e.g. "archive/data/0"
  uint64_t local_header_offset = 0;
  uint64_t size = 0;  // stored: compressed size == uncompressed size
  uint32_t crc32 = 0;
};

// A tensor item: where its raw storage bytes are, and how the tensor views them.
struct TorchTensorItem {
  std::string torch_dtype;      // canonical torch dtype name: "float32", "bfloat16", ...
  size_t element_size = 0;      // bytes
  std::vector<int64_t> size;    // the tensor's shape
  std::vector<int64_t> stride;  // in elements; DCP keeps views' strides (a .t() is (1, rows))
  int64_t storage_offset = 0;   // in elements
  uint64_t storage_elements = 0;
  bool requires_grad = false;
  int rebuild_version =
      2;  // 2: typed storage; 3: untyped storage + dtype (torch 2.x, newer dtypes)
  std::string archive_name;  // "archive" for DCP items
  std::string storage_key;   // the record is <archive_name>/data/<storage_key>
  uint64_t data_offset = 0;  // the storage's first byte, relative to the item's first byte
  uint64_t data_size = 0;    // bytes: storage_elements * element_size
  uint32_t data_crc32 = 0;   // CRC-32 of those bytes, from the central directory

  int64_t numel() const;
  // Row-major contiguous: the elements are the bytes [ContiguousRange()) in C order. Dimensions
  // of size 1 may have any stride; an empty tensor is contiguous.
  bool IsContiguous() const;
  // The item-relative byte range (offset, length) of the tensor's elements when IsContiguous();
  // FailedPrecondition naming the size and stride otherwise.
  Result<std::pair<uint64_t, uint64_t>> ContiguousRange() const;
  // When the tensor is a permuted view of a row-major block of its storage (how DCP saves a
  // transposed or permuted tensor): its dimensions from outermost to innermost in storage order.
  // The storage then holds, from storage_offset on, the row-major array of shape
  // (size[order[0]], ..., size[order[n-1]]). Identity for a contiguous tensor;
  // FailedPrecondition for other strides (expanded or sliced views).
  Result<std::vector<int>> StorageOrder() const;
};

// Reads a tensor item of `item_length` bytes. `source` (e.g. "ckpt/__0_0.distcp item at
// 1234") prefixes every error (kDataLoss, naming the offset and what was expected there).
Result<TorchTensorItem> ReadTorchTensorItem(uint64_t item_length, const ItemReadFn& read,
                                            std::string_view source,
                                            ItemReadStats* stats = nullptr);
// The same, over the item's bytes in memory.
Result<TorchTensorItem> ParseTorchTensorItem(std::span<const uint8_t> item,
                                             std::string_view source);

// The item at [item_offset, item_offset + item_length) of a data file (a DCP _StorageInfo):
// reads through file.ReadAt, names "<path> item at <offset>" in errors.
Result<TorchTensorItem> ReadTorchTensorItem(const ReadableFile& file, uint64_t item_offset,
                                            uint64_t item_length, ItemReadStats* stats = nullptr);

// An object item (a DCP BytesStorageMetadata entry).
struct TorchObjectItem {
  // True when the item is a torch.save zip archive (it starts with a zip local header, as
  // torch.load decides); false when it is raw bytes, which `data` then holds whole.
  bool is_zip = false;
  std::vector<uint8_t> data;  // is_zip: the data.pkl record (checked against its CRC-32)
  std::string archive_name;
  std::vector<ZipRecord> records;  // is_zip: every record, in central directory order
};
Result<TorchObjectItem> ReadTorchObjectItem(uint64_t item_length, const ItemReadFn& read,
                                            std::string_view source,
                                            ItemReadStats* stats = nullptr);
Result<TorchObjectItem> ParseTorchObjectItem(std::span<const uint8_t> item,
                                             std::string_view source);
Result<TorchObjectItem> ReadTorchObjectItem(const ReadableFile& file, uint64_t item_offset,
                                            uint64_t item_length, ItemReadStats* stats = nullptr);

// Checks the CRC-32 of every record of the item (tensor or object) at [item_offset, item_offset
// + item_length) of `file`: reads its central directory, then each record's data in pieces of
// at most 1 MiB. Adds the records' bytes to *bytes_checked. Errors (kDataLoss) name the file,
// the item's offset and the record ("<name> has CRC-32 X, the central directory says Y"). An
// object item that is not a zip archive (raw bytes) has nothing to check.
Status CheckTorchItemRecords(const ReadableFile& file, uint64_t item_offset, uint64_t item_length,
                             ItemReadStats* stats, uint64_t* bytes_checked);
// The same over an item in memory; `source` prefixes errors.
Status CheckTorchItemRecords(std::span<const uint8_t> item, std::string_view source,
                             uint64_t* bytes_checked);

// ---- writing ----------------------------------------------------------------------------------

// A contiguous tensor as torch.save writes it (storage offset 0, row-major strides).
struct TorchTensorSpec {
  std::string torch_dtype;  // a name FindTorchDType knows: "float32", "bfloat16", ...
  std::vector<int64_t> size;
  bool requires_grad = false;
};

// The bytes of a tensor item around its data: [prefix][data_size bytes of data][suffix].
struct TorchItemLayout {
  std::vector<uint8_t> prefix;  // complete; write at the item's offset 0
  uint64_t data_offset = 0;     // == prefix.size(); a multiple of 64
  uint64_t data_size = 0;       // numel * element size
  uint64_t suffix_size = 0;     // what TorchItemSuffix returns, known before the data
  uint64_t total_size = 0;      // the item's length: prefix + data + suffix

  // Inputs of the suffix (the records after the data).
  std::string archive_name;
  std::vector<ZipRecord> records;  // data.pkl, data/0, version (data/0's crc32 set later)
};

// Lays out the item of a contiguous tensor. InvalidArgument for an unknown dtype or a negative
// dimension. Tensors of dtypes torch 1.13 lacks (float8, uint16/32/64) use _rebuild_tensor_v3
// over an untyped storage, as torch 2.x does; torch 1.13 cannot load those.
Result<TorchItemLayout> LayOutTorchTensorItem(const TorchTensorSpec& spec);
// The suffix: data descriptor, version record, central directory, end records. `data_crc32`
// is the CRC-32 of the data_size data bytes (Crc32Stream). Exactly layout.suffix_size bytes.
std::vector<uint8_t> TorchItemSuffix(const TorchItemLayout& layout, uint32_t data_crc32);
// The whole item, for small tensors and tests: prefix + data + suffix. `data` must hold
// layout.data_size bytes.
Result<std::vector<uint8_t>> MakeTorchTensorItem(const TorchTensorSpec& spec,
                                                 std::span<const uint8_t> data);

// The item torch.save(obj) writes, given obj's pickle (the data.pkl record; torch.save uses
// protocol 2). Records: data.pkl, version. For objects that hold no tensors.
std::vector<uint8_t> MakeTorchObjectItem(std::span<const uint8_t> data_pkl);
// The data.pkl torch.save(bytes(raw)) writes: protocol 2, _codecs.encode(latin-1 text) (or
// bytes() for b""), byte for byte as CPython.
std::vector<uint8_t> PickleBytesObject(std::span<const uint8_t> raw);
// torch.save(bytes(raw)): MakeTorchObjectItem(PickleBytesObject(raw)).
std::vector<uint8_t> MakeTorchBytesItem(std::span<const uint8_t> raw);

}  // namespace tessera::torch_dist

#endif  // TESSERA_FORMAT_TORCH_DIST_TORCH_ZIP_H_
