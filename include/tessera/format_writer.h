// The write side of a Format (tessera/format.h), part of the format plug-in API: what a codec
// tells the one write engine (tessera's src/checkpoint/data_files.h) about its data files. The
// engine owns everything that does not depend on the format: the threads, device staging,
// progress, writeback, checksums and the removal of files a failed save created. A codec owns
// only bytes:
//   - the name of each data file (DataFileName), and what a save directory must not hold
//     (CheckTarget);
//   - each file's header and where each item starts in it, and how an item's bytes are framed
//     (DataFileEncoder, ItemWriter): tessera writes a safetensors header and the raw bytes;
//     PyTorch DCP writes every chunk as a torch.save zip item and no header.
// A codec never calls back into the engine: it sees items only as ItemToWrite (core types).
//
// and for the index the coordinator commits once every rank wrote (the engine's CommitIndex,
// src/checkpoint/commit.h, does the committing: the checks, the sync, the publish, the read
// back, and the cleanup after it):
//   - how the index is named: numbered create-only commits (tessera's tessera.manifest.<n>) or
//     one name each commit replaces (DCP's .metadata);
//   - its bytes, checked to read back as written (EncodeIndex), and whether an index found in
//     its place later is another save's (ReplacedByLaterSave);
//   - which files of a directory carry a save id of its own, and which files an index
//     references (SaveIdOfFile, FilesOfIndex), for the cleanup of a replaced index.
#ifndef TESSERA_FORMAT_WRITER_H_
#define TESSERA_FORMAT_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/bytes.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

// One item as the engine hands it to a codec: a chunk of a tensor or a whole object.
struct ItemToWrite {
  std::string key;
  bool object = false;       // a whole object (its bytes), else a tensor chunk
  DType dtype = DType::kU8;  // tensors
  Shape global_shape;        // tensors
  Box box;                   // tensors: the chunk
  uint64_t num_bytes = 0;    // the item's data bytes (row-major, little-endian for tensors)
  ObjectEncoding object_encoding = ObjectEncoding::kBytes;  // objects
};

// Where a placed item's bytes lie in its data file (DataFileEncoder::PlaceItem).
struct ItemPlacement {
  uint64_t data_offset = 0;    // the item's first data byte, in the file
  uint64_t stored_length = 0;  // from the item's offset: its framing and data
};

// Frames one item's bytes in a data file. The engine calls Append with the item's bytes in
// order, in pieces of any size (a piece at most kWritePiece in practice), then Finish once.
// Used by one thread at a time.
class ItemWriter {
 public:
  virtual ~ItemWriter() = default;
  // Writes the next `n` bytes of the item. InvalidArgument past the item's num_bytes; the
  // file's errors.
  virtual Status Append(const std::byte* data, size_t n) = 0;
  // The file offset just past the last byte written so far (the engine hands what lies before
  // it to StartWriteback).
  virtual uint64_t position() const = 0;
  // Writes what follows the data, once every byte was appended; returns the item's stored
  // length from where it started (its data bytes plus any framing).
  virtual Result<uint64_t> Finish() = 0;
};

// One data file's layout: made by FormatWriter::NewDataFile for its items, before any byte of
// any file is written (so what a codec refuses costs nothing to undo).
class DataFileEncoder {
 public:
  virtual ~DataFileEncoder() = default;
  // The bytes at offset 0, before any item (empty for none).
  virtual const Bytes& header() const = 0;
  // Where item `k` (in the order given to NewDataFile) starts, `end_of_previous` being where
  // the previous item ended (header().size() for the first).
  virtual uint64_t ItemOffset(size_t k, uint64_t end_of_previous) const = 0;
  // Begins item `k` at `offset` (ItemOffset's answer) in `out`, writing any framing that
  // precedes its data.
  virtual Result<std::unique_ptr<ItemWriter>> BeginItem(WritableFile& out, size_t k,
                                                        uint64_t offset) const = 0;

  // ---- Items written by position, from several threads at once (Convert writes a large
  // tensor's data in units, in any order), instead of in order through BeginItem.
  // Item `k` placed at `offset` (ItemOffset's answer): where its data begins and its stored
  // length (data plus framing). nullopt when the item can only be written in order through
  // BeginItem, its length known once written (DCP's objects: their pickles are built whole).
  virtual std::optional<ItemPlacement> PlaceItem(size_t k, uint64_t offset) const = 0;
  // Writes the framing of item `k` placed at `offset` (what precedes and follows its data,
  // nothing for raw items), once its data is written there. `data_crc32`: the CRC-32 of its
  // data when the format's framing records one (FormatWriter::FramingChecksum), else 0.
  virtual Status WriteFraming(WritableFile& out, size_t k, uint64_t offset,
                              uint32_t data_crc32) const {
    return Status::Ok();
  }
};

// What one save writes in a format (Format::NewWriter makes one per save, from its options).
// Thread safety: const methods, called from every writer thread at once.
class FormatWriter {
 public:
  virtual ~FormatWriter() = default;
  // The name of data file `file_index` of `rank` in save `save_id`; `attempt` tells apart the
  // files of a rank-local save's retries (empty otherwise). A save never overwrites a file of
  // the checkpoint it replaces, so every name carries the save id.
  virtual std::string DataFileName(const std::string& save_id, int rank, int file_index,
                                   const std::string& attempt) const = 0;
  // Refuses a save into `dir` whose entries are `names` when they would hide the checkpoint it
  // writes from readers (FailedPrecondition naming the file).
  virtual Status CheckTarget(const std::string& dir, const std::vector<std::string>& names) const {
    return Status::Ok();
  }
  // Whether every item (tensor chunk or object) goes into a data file of its own, whatever its
  // size: the engine then gives NewDataFile one item at a time (a save's PlanDataFiles, a
  // conversion's plan). False: the engine groups items into files (one per I/O thread).
  virtual bool OneFilePerItem() const { return false; }
  // Whether the engine checksums each item's blocks as it writes them (tessera's XXH3 blocks,
  // Metadata::checksum_block_bytes). False for a format whose framing carries its own
  // checksums (DCP's zip CRC-32) or none.
  virtual bool EngineChecksums() const = 0;
  // Refuses a tensor `key` of `dtype` that this format cannot store (InvalidArgument naming
  // the key; e.g. a dtype torch 1.13 lacks), so that a conversion refuses it before it writes.
  virtual Status CheckTensor(const std::string& key, DType dtype) const { return Status::Ok(); }
  // The layout of one data file of save `save_id` holding `items` in this order. Errors name
  // the key a format cannot store (CheckTensor).
  virtual Result<std::unique_ptr<DataFileEncoder>> NewDataFile(
      const std::vector<ItemToWrite>& items, const std::string& save_id) const = 0;

  // ---- The index.
  // What the index is called in messages ("manifest", ".metadata").
  virtual std::string_view index_description() const = 0;
  // True: every commit publishes a new numbered commit create-only (tessera's
  // "tessera.manifest.<n>"; EncodeIndex is given Metadata::commit_seq of the number it takes).
  // False: every commit replaces the one file IndexFileName (the last commit wins).
  // Numbered commits are the tessera manifest's own protocol (docs/FORMAT.md, section 4.3), not
  // a choice any format can make: the order of commits (checkpoint/sequence.h), the cleanup of
  // superseded ones and the rank-local saves read each commit as a tessera manifest and may
  // reference one from another. Only tessera's writer returns true (registry_test checks it);
  // a new format replaces its one index name, as PyTorch DCP's .metadata and raw_dir do.
  virtual bool NumberedCommits() const = 0;
  // The index's file name: the one name when !NumberedCommits(); commit `commit_seq`'s
  // otherwise.
  virtual std::string IndexFileName(uint64_t commit_seq = 0) const = 0;
  // Turns what the ranks wrote (Metadata::files, every location, the save id) into the index
  // this format stores (DCP: every item a whole torch.save item, no checksums). Idempotent.
  virtual void FinishIndex(Metadata& metadata) const {}
  // The bytes of `metadata`'s index, checked to read back as `metadata` (what the writer
  // writes must pass the reader's validation, or a save would replace a good checkpoint by one
  // nobody can read). `location` is where the checkpoint will be read from (DCP records it as
  // StorageMeta.checkpoint_id). Errors say what would not read back, naming the key.
  virtual Result<Bytes> EncodeIndex(const Metadata& metadata,
                                    const std::string& location) const = 0;
  // !NumberedCommits(): after save `save_id` published its index, the file `path` holds
  // `stored` instead: true when that is a later save's index (it references no file of
  // `save_id`), so this one committed first; false when it is damaged.
  virtual bool ReplacedByLaterSave(std::span<const uint8_t> stored, const std::string& save_id,
                                   const std::string& path) const {
    return false;
  }
  // !NumberedCommits(), for the cleanup after a commit: the save id a file name of this format
  // carries ("" for a name that is not one of tessera's files: never removed), and the files
  // the index `stored` (read from `path`) references.
  virtual std::string SaveIdOfFile(std::string_view name) const { return ""; }
  virtual Result<std::set<std::string>> FilesOfIndex(std::span<const uint8_t> stored,
                                                     const std::string& path) const {
    return std::set<std::string>();
  }

  // ---- Conversions: tessera convert writes every format it converts into through its
  // FormatWriter (Format::NewConversionWriter), laying out each file with NewDataFile and
  // writing its items by position (DataFileEncoder::PlaceItem).
  // The name of output file `file` of the `count` a conversion writes, written by `rank` as
  // its `rank_file`-th. The default: DataFileName(save_id, rank, rank_file, "").
  virtual std::string ConversionFileName(const std::string& save_id, int rank, int rank_file,
                                         int file, int count) const {
    return DataFileName(save_id, rank, rank_file, "");
  }
  // Whether the data files carry the checkpoint's own names, with no commit file that makes
  // them one (Hugging Face: a reader takes the files it finds). A conversion then writes each
  // under a hidden name, gives each its name once all are complete, and publishes the index
  // (when NeedsIndex) create-only, last. Otherwise the files carry the save id and mean
  // nothing until CommitIndex publishes the index that names them.
  virtual bool FilesAreTheCheckpoint() const { return false; }
  // Whether a checkpoint of `num_files` data files has an index file (Hugging Face: only a
  // sharded one).
  virtual bool NeedsIndex(size_t num_files) const { return true; }
  // Whether the format stores objects (non-tensor values). A conversion into one that does
  // not lists them as skipped.
  virtual bool StoresObjects() const { return true; }
  // Whether the index keeps Metadata::user_metadata, so that a conversion carries the
  // source's over (DCP and Hugging Face have no place for it).
  virtual bool StoresUserMetadata() const { return true; }
  // The checksum of each item's data its framing records (DCP's zip CRC-32: kCrc32), that an
  // engine writing the data by position computes block by block and combines for
  // DataFileEncoder::WriteFraming; kNone when the framing records none.
  virtual ChecksumKind FramingChecksum() const { return ChecksumKind::kNone; }
};

// An ItemWriter for raw bytes at a fixed offset: no framing, the item's length its data size.
// What a format that stores items as they are (tessera) returns from BeginItem.
class RawItemWriter final : public ItemWriter {
 public:
  RawItemWriter(WritableFile& out, uint64_t offset, uint64_t num_bytes)
      : out_(&out), offset_(offset), num_bytes_(num_bytes) {}
  Status Append(const std::byte* data, size_t n) override;
  uint64_t position() const override { return offset_ + done_; }
  Result<uint64_t> Finish() override;

 private:
  WritableFile* out_;
  uint64_t offset_;
  uint64_t num_bytes_;
  uint64_t done_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_FORMAT_WRITER_H_
