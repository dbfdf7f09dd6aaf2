// Convert: rewrite a checkpoint of any format tessera reads into another format, streaming.
//
//   Convert("/ckpt/step1000", "/export/model", {.to = CheckpointFormat::kSafetensors}, comm);
//
// The source is anything ReadMetadata reads (a tessera checkpoint, PyTorch DCP / Megatron
// torch_dist, Hugging Face safetensors files or one .safetensors file); its format is
// detected. Every output tensor is whole (a tensor saved in pieces by many ranks is put back
// together); it is loaded unit by unit, each unit a run of at most `buffer_bytes / threads`
// (and 32 MiB) bytes of the output, so memory is bounded by the buffer, not by the checkpoint,
// and each source byte is read about once.
//
// Targets:
//   kSafetensors: Hugging Face files: one "model.safetensors" when everything fits in
//     max_file_bytes, else "model-0000i-of-0000N.safetensors" shards and
//     "model.safetensors.index.json" ({"metadata": {"total_size": N}, "weight_map": ...}).
//     Objects are never exported (they are listed in ConvertReport::skipped_objects).
//   kTessera: a tessera checkpoint (docs/FORMAT.md), every tensor one chunk with checksums,
//     objects copied with their encoding, the source's user metadata kept.
//   kTorchDist: a PyTorch DCP directory (Megatron-Core's torch_dist) that torch's own
//     `load_state_dict` reads, as Save with SaveFormat::kTorchDist writes it
//     (docs/FORMAT_TORCH_DIST.md): every tensor whole, one torch.save item streamed unit by
//     unit (its zip CRC-32 computed per block by the threads that write them, then combined),
//     objects as byte items, `.metadata` (TorchDistOptions::flavor's class paths) committed last
//     and atomically, as a save commits it. The source's user metadata is not carried over (DCP has
//     no place for it).
//
// DST is a checkpoint or none: the output is written into DST and committed there the way its
// format commits a save, and no directory is ever renamed. DST must not exist (it is created,
// with its parents), or be an empty directory, or hold only what a conversion that died left
// (its in-progress marker "tessera.saving.<id>", naming a process that ended, and files
// carrying that id), which is removed first. tessera and torch_dist data files carry the
// conversion's id in their names and mean nothing until the manifest or `.metadata` is
// published. Hugging Face files are written under hidden names
// (".<name>.tessera-convert-<id>"), synced, renamed to their names once every file is
// complete, then the index is published. A conversion that fails removes what it wrote (and
// DST when it created it); one whose process dies leaves its marker and files, which the next
// conversion into DST removes.
//
// Convert taking a Comm is COLLECTIVE: every rank calls it with the same paths and options.
// Rank 0 reads the source's index once and shares it; the output files are spread over the
// ranks (each writes its own, loading only the bytes they need); rank 0 commits. Every rank
// returns the same status.
#ifndef TESSERA_CONVERT_H_
#define TESSERA_CONVERT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/checkpoint.h"
#include "tessera/comm.h"
#include "tessera/dtype.h"
#include "tessera/formats.h"
#include "tessera/metadata.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

struct ConvertOptions {
  // The output format. Default Hugging Face safetensors.
  CheckpointFormat to = CheckpointFormat::kSafetensors;
  // Largest output file, in data bytes (a tensor larger than this gets a file of its own).
  // Default 5 GB (5e9 bytes), as transformers' save_pretrained. More files cost nothing but
  // their number; with several ranks, files are the unit of work spread over them.
  uint64_t max_file_bytes = 5'000'000'000;
  // Keep only the keys (tensors and objects) that start with one of these prefixes, e.g.
  // {"model."}. Default: everything.
  std::vector<std::string> keys;
  // Removed from the start of every output key that has it, e.g. "model." (the source keys
  // are matched against `keys` before it is removed). Default none. Two keys that become the
  // same name are an error naming both.
  std::string strip_prefix;
  // When set, every F64, F32, F16 and BF16 tensor is written in this dtype (one of those
  // four), rounded to nearest, ties to even; other dtypes (integers, bool, float8) are kept.
  // Default: every tensor keeps its dtype.
  std::optional<DType> dtype;
  // Threads per rank, each loading, converting and writing one unit at a time. Default 4.
  int num_threads = 4;
  // Memory for units, per rank, in bytes: each thread works on units of at most
  // buffer_bytes / num_threads (half of that for output and half for the source when dtypes
  // change), and of at most 32 MiB, so the default uses 128 MiB with 4 threads. Default
  // 256 MiB; units of at least 1 MiB are used whatever this says. Objects (tessera target) are
  // held whole, one per thread at a time.
  uint64_t buffer_bytes = 256ull << 20;
  // Default kFull: every output file is fdatasync'ed, the directories are synced around the
  // final rename. kNone skips every sync.
  SyncPolicy sync = SyncPolicy::kFull;
  // Options of `to` (tessera/formats.h): none (the default), or TorchDistOptions with
  // kTorchDist: its flavor (kTorch113 refuses, before writing anything, a tensor of a dtype
  // torch 1.13 lacks: float8, uint16/32/64) and key_paths (planner_data; default (key,) for
  // each output key). Options of another format are refused (InvalidArgument).
  FormatOptions format_options;
  // Deprecated (kept for one release): TorchDistOptions::flavor in format_options. Used when
  // format_options holds no TorchDistOptions; setting both is refused (InvalidArgument).
  TorchDistFlavor torch_dist_flavor = TorchDistFlavor::kTorch2;
  // Check the source's checksums where it has them (tessera), as LoadOptions::verify_checksums.
  // Default true.
  bool verify_checksums = true;
  // Called on each rank with the bytes of output it has written so far and the bytes it
  // writes in all, from one thread (the calling one), every 100 ms while it writes and once
  // at the end. Default none.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // Where the source is, and the output unless output_storage is set; SRC and DST are then
  // paths inside it. Default null: SRC and DST are paths or URIs, each resolved by OpenStorage
  // (storage_uri.h): "s3://bucket/ckpt", "msc://profile/ckpt", "file:///ckpt", a local path.
  std::shared_ptr<Storage> storage;
  // Where the output is, when not in `storage`. Default null.
  std::shared_ptr<Storage> output_storage;
  // An output store without positional writes (an object store such as S3; for a Hugging Face
  // output, also one without rename) cannot take the files as a conversion writes them (at
  // offsets, by several threads): the output is then made in a new directory under this local one
  // (default: the system's temporary directory, $TMPDIR) and uploaded file by file, the index
  // (manifest, `.metadata`, index.json) last, so that it is visible whole or not at all; then the
  // local copy is removed. Needs room for the whole output; one process only (a Convert over
  // several ranks into such a store is refused).
  std::string staging_dir;
};

struct ConvertReport {
  CheckpointFormat source_format = CheckpointFormat::kTessera;
  uint64_t tensors = 0;            // written, by all ranks
  uint64_t objects = 0;            // written, by all ranks
  uint64_t total_bytes = 0;        // of the output's tensors and objects, all ranks
  uint64_t bytes_written = 0;      // data bytes written by this rank (headers not counted)
  uint64_t bytes_read = 0;         // from the source by this rank
  std::vector<std::string> files;  // every output file, relative to DST
  int files_written = 0;           // by this rank
  std::vector<std::string> skipped_objects;  // source objects the target cannot hold
};

Result<ConvertReport> Convert(const std::string& src, const std::string& dst,
                              const ConvertOptions& options, Comm& comm);
Result<ConvertReport> Convert(const std::string& src, const std::string& dst,
                              const ConvertOptions& options = {});

// "tessera", "torch_dist", "safetensors" (CheckpointFormatName's names) -> the format.
// InvalidArgument naming the text otherwise.
Result<CheckpointFormat> CheckpointFormatFromName(const std::string& name);

}  // namespace tessera

#endif  // TESSERA_CONVERT_H_
