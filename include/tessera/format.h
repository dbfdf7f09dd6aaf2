// The format plug-in API: the interface a checkpoint format implements, so that tessera reads,
// saves and converts into it. tessera's own formats are codecs of it (src/format/<name>/:
// tessera, PyTorch DCP / Megatron torch_dist, Hugging Face safetensors), found through the
// registry (tessera/format_registry.h), never by name; a format written outside tessera
// implements it the same way, registers it for its tests (ScopedFormatRegistration) and runs
// the Format conformance suite on it (tessera/testing/format_suite.h). The interface speaks
// public types only (Metadata, Storage, Status): a codec never calls back into the engine that
// loads and saves (docs/DESIGN.md, "Formats").
//
// What a codec does on the read side:
//   - claims a directory from its file names alone (Claim), or a single file (ClaimsFile);
//   - reads the directory's index into Metadata (ReadIndex, ReadFileIndex);
//   - resolves chunks stored inside a wrapper into raw byte ranges (PyTorch DCP's torch.save
//     items), lazily, for the chunks a load touches (ResolveWrappedChunks);
//   - says what a read checks of the stored bytes besides tessera's block checksums: whether
//     each data file carries a safetensors header describing its chunks, and the format's own
//     checks of wrapped items (VerifyItems, CheckObjectBytes);
//   - says which file names are its own (CountsFile), for ls and cleanups.
// and on the write side, makes the FormatWriter of a save or a conversion
// (tessera/format_writer.h): file names, file headers, the framing of items and the index, for
// the one write engine of saves and the one of conversions.
//
// The contract: a Format is one immutable object (a function-local static) that outlives
// every use of it, and serves every save, load and conversion of the process at once: its
// methods are const and may be called from any number of threads (the ranks of LocalComm are
// threads). It holds no state between calls; what one save needs lives in its FormatWriter.
// Errors are Status values, never exceptions, and name the file (and the key, the offset)
// that is wrong. Its id and name are unique in the registry.
#ifndef TESSERA_FORMAT_H_
#define TESSERA_FORMAT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/format_writer.h"
#include "tessera/formats.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

struct SaveOptions;     // tessera/checkpoint.h
struct ConvertOptions;  // tessera/convert.h

// What a format makes of a directory from its file names (Format::Claim). The registry turns
// the claims of every format into one choice.
enum class DirectoryClaim : uint8_t {
  kNone = 0,    // none of the format's files
  kData,        // data files that are a checkpoint without any commit file (Hugging Face)
  kUnfinished,  // files of a save of this format that never committed (no commit file)
  kCommitted,   // a commit file of this format (tessera.manifest.<n>, DCP's .metadata)
};

// A chunk of an index by position: (index into Metadata::tensors, index into its chunks).
using ChunkRef = std::pair<uint32_t, uint32_t>;

// What a codec read of items' structure (zip directories, pickles) besides their data.
struct FormatReadStats {
  uint64_t bytes = 0;
  int64_t reads = 0;
};

// An index a codec read.
struct FormatIndex {
  std::string root;  // the directory Metadata::files are relative to
  Metadata metadata;
  // tessera: the index is the merge of a rank-local save's rank manifests (docs/FORMAT.md, 4.2);
  // metadata.commit_seq is then its reference's number.
  bool rank_local = false;
};

class Format {
 public:
  virtual ~Format() = default;

  // The format's enum value and name ("tessera", "torch_dist", "safetensors"): the names users
  // give to --to and SaveOptions, and that Metadata::format reports. A format registered for
  // tests (tessera/format_registry.h, ScopedFormatRegistration) has an id outside the enumerators
  // and names itself; the default name is CheckpointFormatName's.
  virtual CheckpointFormat id() const = 0;
  virtual const char* name() const { return CheckpointFormatName(id()); }
  // What makes a directory one of its checkpoints, for the error that finds none (e.g.
  // "PyTorch DCP .metadata").
  virtual std::string_view commit_description() const = 0;

  // ---- Claiming, from names alone (no I/O).
  // `sorted_names`: the entries of the directory, sorted.
  virtual DirectoryClaim Claim(const std::vector<std::string>& sorted_names) const = 0;
  // The files of a directory this format claimed with `claim` that belong to the checkpoint
  // (or to the unfinished save): what `tessera ls` counts and sums.
  virtual bool CountsFile(std::string_view name, DirectoryClaim claim) const = 0;
  // Whether a path to one file (not a directory) is a checkpoint of this format.
  virtual bool ClaimsFile(std::string_view file_name) const { return false; }
  // Whether subdirectories of one of its checkpoints may hold other checkpoints (the Hugging
  // Face Trainer keeps checkpoint-N/ beside its final model); ls searches on below them.
  virtual bool NestsCheckpoints() const { return false; }

  // ---- The index.
  // Reads the checkpoint of directory `dir` whose sorted entries are `sorted_names` (a
  // directory this format claimed). Errors name the file; kFailedPrecondition means the
  // directory holds no complete checkpoint of this format (another format may still claim
  // it); kNotFound means a file listed vanished meanwhile (the caller lists again). What a
  // format registered from outside tessera reads (ReadIndex, ReadFileIndex) is held by the
  // engine to every rule of an index (docs/FORMAT.md, 3.3: sorted unique keys, chunks inside
  // their files, tiling their tensors, ...) before anything uses it: an index that breaks one
  // is an error naming the directory and the format.
  virtual Result<FormatIndex> ReadIndex(Storage& storage, const std::string& dir,
                                        const std::vector<std::string>& sorted_names) const = 0;
  // Reads the checkpoint that is the one file `dir`/`name` (ClaimsFile).
  virtual Result<FormatIndex> ReadFileIndex(Storage& storage, const std::string& dir,
                                            const std::string& name) const;

  // ---- Stored bytes.
  // Whether every data file is a safetensors file whose header must describe each chunk and
  // object the index places in it. Other readers go by those headers, so Verify and every load
  // (issue 22) check them (DataFileHeaders) for each chunk and object they use.
  virtual bool DataFilesHaveHeaders() const = 0;
  // Whether some chunk of `metadata` is stored inside a wrapper (ChunkEncoding other than
  // raw) that ResolveWrappedChunks must turn into byte ranges before planning reads.
  virtual bool HasWrappedChunks(const Metadata& metadata) const { return false; }
  // The checksum kind of chunks once resolved (e.g. kCrc32 of DCP's zip records).
  virtual ChecksumKind resolved_checksum() const { return ChecksumKind::kNone; }
  // Resolves the wrapped chunks among `chunks` (sorted) of `metadata` in place, reading their
  // items under `root` with `num_threads` threads. Errors name the key, the file and the offset.
  virtual Status ResolveWrappedChunks(Storage& storage, const std::string& root, Metadata& metadata,
                                      const std::vector<ChunkRef>& chunks, int num_threads,
                                      FormatReadStats* stats) const;
  // Verify's check of what the format wraps: every wrapped item's structure, and the format's
  // own checksums of its bytes. Adds the bytes read for structure to `structure_bytes` and the
  // bytes whose checksums it checked to `bytes_checked`; sets *checksummed when the format's
  // checksums covered the items (DCP: the CRC-32 of every zip record).
  virtual Status VerifyItems(Storage& storage, const std::string& root, const Metadata& metadata,
                             int num_threads, uint64_t* structure_bytes, uint64_t* bytes_checked,
                             bool* checksummed) const;
  // A read's check of the bytes of `object`, read whole from `where`: true when the format
  // checked them by its own means (tessera's XXH3 is then not expected), false when it has
  // none for this object. An error names `where`.
  virtual Result<bool> CheckObjectBytes(const ObjectInfo& object, const std::vector<uint8_t>& bytes,
                                        const std::string& where) const;

  // ---- Writing.
  // Whether tessera saves in this format (NewWriter succeeds for some options).
  virtual bool CanWrite() const { return false; }
  // Checks the format options of a save or conversion into this format (`options`, the field
  // `field`, e.g. "SaveOptions::format_options") before anything is written. The default takes
  // none (std::monostate); a format with an options struct of its own (tessera/formats.h)
  // overrides it. BadOption naming the field and the struct held otherwise.
  virtual Status CheckOptions(const FormatOptions& options, const std::string& field) const;
  // The writer of one save with `options` (whose `format` is this one) on a rank that is the
  // coordinator or not (the coordinator's user_metadata is the one saved). Checks the options
  // before anything is written: BadOption naming an option the format has no place for;
  // InvalidArgument naming the formats that can be written when this one cannot (the default).
  virtual Result<std::unique_ptr<FormatWriter>> NewWriter(const SaveOptions& options,
                                                          bool coordinator) const;
  // Whether tessera converts into this format (NewConversionWriter succeeds for some
  // options): every format it saves, and formats it only exports to (Hugging Face).
  virtual bool CanConvertInto() const { return CanWrite(); }
  // The writer of a conversion into this format with `options` (whose `to` is this one; its
  // format_options already passed CheckOptions). The default is NewWriter's for a save with
  // the same format options, on the coordinator; InvalidArgument naming the formats that can
  // be converted into when this one cannot.
  virtual Result<std::unique_ptr<FormatWriter>> NewConversionWriter(
      const ConvertOptions& options) const;
};

// The name of the options struct `options` holds ("TorchDistOptions"; "" for none), for
// messages.
std::string FormatOptionsName(const FormatOptions& options);

}  // namespace tessera

#endif  // TESSERA_FORMAT_H_
