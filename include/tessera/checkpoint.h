// The front door: Save, Load, ReadMetadata, Verify.
//
// A checkpoint is a directory holding data files (each a valid safetensors file) and one
// manifest, written last and atomically: a directory without a manifest holds no checkpoint.
// See docs/FORMAT.md. Save can also write PyTorch DCP (torch_dist) checkpoints, which torch's
// own DCP reads (SaveOptions::format; docs/FORMAT_TORCH_DIST.md).
//
// Save and Load taking a Comm are COLLECTIVE: every rank of `comm` calls them with the same
// path and options. The overloads without a Comm run as a single rank.
#ifndef TESSERA_CHECKPOINT_H_
#define TESSERA_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "tessera/comm.h"
#include "tessera/device.h"
#include "tessera/formats.h"
#include "tessera/metadata.h"
#include "tessera/state_dict.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

// The numeric values are not written to disk.
enum class SyncPolicy {
  kFull,  // fdatasync every data file, fsync the manifest and the directory (default)
  kNone,  // no syncs at all: fastest; a crash of the machine may lose or tear the checkpoint
};

struct SaveOptions {
  // What to write. Default CheckpointFormat::kTessera (docs/FORMAT.md).
  // CheckpointFormat::kTorchDist writes a PyTorch DCP directory (Megatron-Core's torch_dist
  // backend) that torch's own `load_state_dict` reads: every chunk a torch.save item and every
  // object a byte item in `__<rank>_<n>.tsr-<save_id>.distcp` files, and `.metadata` (a pickle of
  // torch's classes) written last and atomically; the same planning, threads and commit protocol
  // (docs/FORMAT_TORCH_DIST.md). No checksums (DCP has none), about 1 KiB of zip records per
  // chunk; user_metadata must be empty (DCP has no place for it); a directory holding a tessera
  // checkpoint is refused. Objects become what torch.load gives back: kPickle the unpickled
  // value, kBytes and kJson a bytes object, kTorchSave whatever was saved. kSafetensors is not
  // writable (InvalidArgument).
  CheckpointFormat format = CheckpointFormat::kTessera;
  // Options of `format` (tessera/formats.h): none (the default), or TorchDistOptions with
  // kTorchDist. Options of another format are refused (InvalidArgument).
  FormatOptions format_options;
  // Deprecated (kept for one release): TorchDistOptions::flavor in format_options. Used when
  // format_options holds no TorchDistOptions; setting both is refused (InvalidArgument).
  TorchDistFlavor torch_dist_flavor = TorchDistFlavor::kTorch2;
  // Deprecated (kept for one release): TorchDistOptions::key_paths in format_options, with the
  // same rule as torch_dist_flavor.
  std::map<std::string, std::vector<TorchDistPathElement>> torch_dist_key_paths;

  // Data files each rank writes in parallel, one per I/O thread. 0 (the default): 2, or 1 on a
  // store without positional writes (an object store: a file's parts upload in parallel
  // anyway, and each file costs a create and a completion request besides its parts). More
  // threads help on fast parallel storage and cost one file and one thread each.
  int num_io_threads = 0;
  // Default kFull. kNone skips every sync (page-cache speed, no durability).
  SyncPolicy sync = SyncPolicy::kFull;
  // Spread the writing of replicated shards over every rank that holds them instead of only
  // the main replica. Default false. Costs nothing extra; helps when many ranks share a shard.
  bool balance_writes = false;
  // Stored in the manifest; ReadMetadata returns it. Rank 0's value is used. Keys and values
  // must be valid UTF-8 (else the save fails with InvalidArgument naming the key).
  std::map<std::string, std::string> user_metadata;
  // After the new manifest is committed, remove the data files of the previous save and of
  // interrupted saves (tessera-named files the manifest does not list). Default true. With
  // kTorchDist: the files of earlier tessera saves the new `.metadata` does not reference, never
  // a file torch wrote (one without a tessera save id in its name).
  bool remove_stale_files = true;
  // Reuse the previous save's plan when every rank's holdings are unchanged: one small
  // all-reduce instead of gathering, validating and scattering plans. Default true. The cache
  // lives with the Comm.
  bool plan_cache = true;
  // Key prefixes whose chunks and objects go into data files of their own (Megatron-Core's
  // separation_hint), e.g. {"optimizer."}: removing such a prefix later (RemoveKeys) deletes
  // whole files instead of rewriting them. Recorded in the manifest. Default none. Costs up to
  // num_io_threads more files per prefix and rank.
  std::vector<std::string> separate_prefixes;
  // Called on each rank with the bytes it has written so far and the bytes it writes in all,
  // from one thread (the calling one), every 100 ms while data files are written and once at
  // the end. Default none.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // Default true: the ranks plan together (dedup, balance, one manifest committed last), a few
  // small collectives. false: a rank-local save, with no Comm call at all (the comm only gives
  // rank and size): every rank writes the boxes and objects it holds as the main replica and
  // commits a manifest of its own part; rank 0 also places the save in the directory's order of
  // commits (docs/FORMAT.md, section 4.2: the order is the directory's, never a clock's; the
  // ranks may finish in any order). Load, ReadMetadata,
  // Verify and inspect treat the parts as one checkpoint once every rank's is there and their
  // union covers every tensor; Finalize merges them into one manifest. Requires `save_tag`;
  // format kTessera only. Costs: no dedup of replicas that all claim the main replica (the
  // merge keeps one), no balance_writes, no cleanup of earlier saves until Finalize or the
  // next collective save, and rank 0 reads every rank's manifest on load until Finalize.
  bool collective = true;
  // With collective false, required: names the save on every rank without a message (e.g.
  // "step-1000"); the save id is a hash of it, so it must differ from save to save into one
  // directory (a tag whose part a rank already committed is refused, naming it). Two jobs
  // saving one tag at once: the second is refused (kAlreadyExists naming the first's process),
  // unless the first is dead, whose marker it takes over.
  std::string save_tag;
  // Where files go; `path` is then a path inside it. Default null: `path` is a local path or a
  // URI ("s3://bucket/ckpt", "msc://profile/ckpt", "file:///ckpt"), opened by ResolveStorage
  // (storage_uri.h) on every rank.
  std::shared_ptr<Storage> storage;
  // Tensors in device memory (TensorView::device) are copied to host memory in pieces through
  // pinned buffers as the data files are written: only the bytes this rank writes, each piece
  // written (and checksummed) as soon as it lands. See DeviceStagingOptions for the budget,
  // the piece size and on_staged (when the caller may change its device tensors again).
  DeviceStagingOptions device_staging;
};

struct SaveReport {
  std::string save_id;
  uint64_t bytes_written = 0;   // by this rank (data files only)
  uint64_t total_bytes = 0;     // by all ranks, payload of the checkpoint
  int files_written = 0;        // by this rank
  bool plan_cache_hit = false;  // the plan of the previous save was reused
  // Where this rank's time went, in seconds of wall-clock time: planning (its local plan, the
  // agreement on the directory and, when the plan cache misses, the global plan and the scatter
  // of the write lists), writing its data files (checksums and, with SyncPolicy::kFull, the
  // syncs included), and the commit (waiting for the other ranks' writes, the manifest, the
  // outcome every rank learns). Their sum is the call's time less its argument checks.
  double plan_seconds = 0;
  double write_seconds = 0;
  double commit_seconds = 0;
};

// What Load does about a key present on one side only.
enum class KeyPolicy {
  kError,  // fail naming the keys (default)
  kSkip,   // leave it alone and report it in LoadReport
};

// How ranks that need the same bytes share the reading of them (the numbers are not written
// to disk).
// kAuto reads alone on an object store when that reads less than 1 / kReadOnceMinSaving more
// bytes than reading once (see LoadOptions::read_sharing).
inline constexpr uint64_t kReadOnceMinSaving = 20;

enum class ReadSharing {
  kNone,       // every rank reads everything it needs from storage
  kBroadcast,  // ranks with identical needs: one reads each run, then broadcasts it
  kAllGather,  // ranks with identical needs: one reads each run, then all-gather rounds
  kReadOnce,   // the whole job reads each needed checksum block once (see LoadOptions)
  kAuto,       // kReadOnce, but kNone where every rank reads a local filesystem (default)
};

struct LoadOptions {
  // A key this rank asks for that the checkpoint lacks. Default kError.
  KeyPolicy missing_keys = KeyPolicy::kError;
  // A key of the checkpoint that no rank asks for. Default kError.
  KeyPolicy unexpected_keys = KeyPolicy::kError;
  // Check every byte this rank loads against the checkpoint's XXH3-64 checksums: a chunk
  // needed whole by its checksum; a chunk needed in part (a resharded load) by the checksum
  // blocks it touches (Metadata::checksum_block_bytes, 256 KiB as tessera writes them), each
  // read whole, so a load reads at most one block more than it needs at each end of a run.
  // Default true; costs one pass over the bytes read at ~10 GB/s. Formats without checksums
  // (DCP, Hugging Face) and version-1 manifests (one checksum per chunk: partial reads are
  // then checked only with verify_partial_chunks) load unchecked. `tessera verify` checks
  // everything.
  bool verify_checksums = true;
  // Also check the chunks this rank needs only part of when the checkpoint has no checksum
  // blocks (a version-1 manifest), by reading each of them whole (in pieces, through a 256 KiB
  // buffer per I/O thread) and copying out the parts it needs. Default false.
  bool verify_partial_chunks = false;
  // Parallel readers per rank. Default 2.
  int num_io_threads = 2;
  // Load a tensor saved in one float dtype into memory of another (F64, F32, F16, BF16,
  // F8_E4M3, F8_E5M2, in any direction), rounding to nearest, ties to even (as `tessera convert
  // --dtype`; into F8_E4M3 what overflows becomes NaN, as in torch). Default false: a dtype
  // mismatch is an error naming the key and both dtypes. Other mismatches (an integer or bool
  // on either side) are errors either way. The conversion runs on each piece as it is read,
  // while it is in cache (a converted run is read through a 256 KiB buffer per I/O thread, not
  // straight into place); LoadReport::bytes_needed and progress count bytes in memory.
  bool cast_dtypes = false;
  // How ranks share reads (the same on every rank). Default kAuto.
  //
  // kReadOnce: every byte of the checkpoint that some rank needs is read from storage by one
  // rank and checked once, then sent to the other ranks that need it. The unit is the cell: a
  // checksum block (256 KiB as tessera writes them; 256 KiB cells for formats without blocks).
  // Each cell needed by two or more ranks gets one reader among them (the least loaded in bytes;
  // cells needed by fewer ranks first); cells needed by one rank are read by it as with kNone.
  // The readers send in rounds of at most exchange_bytes per rank, one Comm::ScatterInto per
  // sending rank and round: a reader reads each piece once into its send buffer, whatever the
  // number of its receivers, and each receiver's parts land straight in its tensors where they
  // are plain host bytes it needs (LoadReport::bytes_received_in_place; casts, device memory and
  // bytes of a cell it does not need go through a staging buffer). The job then reads the union of
  // its needs, rounded out to cells, once: data-parallel replicas, tensor-parallel slices of the
  // same rows (a resharded load), a whole-tensor load_all, and a flat range's edges all share. It
  // costs two all-gathers (24 bytes per rank, then one list of needed cell ranges per group of
  // ranks with identical needs) and a plan computed on every rank (16,384 ranks: see
  // docs/PERFORMANCE.md). Where no cell is needed by two ranks (disjoint needs, one rank) it reads
  // exactly what kNone does; with one rank it does no communication.
  //
  // kAuto (the default) plans as kReadOnce, then exchanges unless every rank's checkpoint is on a
  // filesystem of its own machine (ext4, xfs, btrfs, tmpfs, ...; not NFS, Lustre, GPFS, BeeGFS,
  // CephFS, CIFS or FUSE) or in memory: there a second read of a block comes from the page cache
  // or a local disk and costs less than sending it (measured on one 2-core machine: the 8-rank
  // demo loads in 0.06 s reading 473.5 MB itself, in 0.14-0.15 s reading 268.1 MB once and
  // exchanging 205.4 MB; a 2-rank 2 GiB reshard from a disk with dropped caches in 0.76-0.80 s
  // alone, 0.81-0.84 s reading once; docs/PERFORMANCE.md, "Read once per job"). Object stores
  // (s3://, msc://) and network filesystems exchange, unless reading alone would read less than
  // 5% more than reading once (kReadOnceMinSaving: a load in its save's layout, where only small
  // replicated tensors are shared; on moto such a load took 0.84 s alone, 1.18 s read once).
  // kReadOnce and kNone force either way; LoadReport::read_sharing says what a load did.
  //
  // kBroadcast, kAllGather: ranks that need exactly the same bytes (data-parallel replicas of
  // the load layout) read them from storage once between them and exchange them through a
  // communicator of their own: the group's storage reads total its unique bytes. Costs an
  // all-gather of a 16-byte signature per rank and a Comm::Split; no rank learns another's read
  // list. Bytes needed by ranks of different groups (e.g. a tensor replicated over
  // tensor-parallel ranks) are read once per group.
  ReadSharing read_sharing = ReadSharing::kAuto;
  // Exchange memory per rank and round, in bytes (the same on every rank). kReadOnce: what a
  // rank reads for others and sends in one round (a piece is cut to at most exchange_bytes /
  // (1 + its receivers), so that a Comm that packs a message per receiver stays within it),
  // plus the staging of what it receives in one message; a piece of one checksum block with
  // more receivers than fit has a round of its own. kAllGather and kBroadcast: what
  // a rank contributes to one round (an all-gather round holds ranks x this in each rank).
  // Default 64 MiB: on this project's 2-core test machine a 2 GiB resharded load of 2 ranks took
  // 0.32-0.42 s with it, 0.61-0.70 s with 128-256 MiB and 0.53-0.57 s with 16 MiB, holding 65
  // MB of exchange memory per rank (docs/PERFORMANCE.md, "Read once per job").
  uint64_t exchange_bytes = 64ull << 20;
  // Called on each rank with the bytes of its requests loaded so far (read from storage or
  // received from other ranks) and LoadReport::bytes_needed, from one thread (the calling one),
  // every 100 ms while data files are read and once at the end (done == total). Default none.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // Where files come from; `path` is then a path inside it. Default null: `path` is a local
  // path or a URI (s3://, msc://, file://; see ResolveStorage in storage_uri.h).
  std::shared_ptr<Storage> storage;
  // Tensors in device memory (TensorView::device) are filled through pinned buffers: runs are
  // read (and checked) into a buffer, which is copied to the device while the next one is read.
  // The copies start after the work queued on each tensor's stream when Load is called, and
  // the stream waits for them: work queued on it after Load returns sees the loaded bytes.
  // DeviceStagingOptions::on_staged is not used.
  DeviceStagingOptions device_staging;
};

struct LoadReport {
  std::vector<std::string> missing_keys;           // asked for, absent, skipped (this rank)
  std::vector<std::string> unexpected_keys;        // in the checkpoint, asked for by no rank
  std::vector<std::string> shape_mismatched_keys;  // loaded in part (allow_shape_mismatch)
  uint64_t bytes_read = 0;                         // from storage by this rank
  uint64_t bytes_needed = 0;                       // bytes this rank's requests cover (in
                                                   // memory, in the requested dtypes)
  uint64_t read_calls = 0;                         // storage reads issued by this rank
  uint64_t bytes_received = 0;                     // from other ranks (read sharing)
  // Of bytes_received, those the Comm put straight into the destination (Comm::ScatterInto:
  // plain host bytes this rank needed); the rest went through a staging buffer (bytes of a
  // received piece this rank did not need, parts converted by cast_dtypes or bound for device
  // memory). Whether the Comm itself copies on the way is the Comm's (comm.h).
  uint64_t bytes_received_in_place = 0;
  uint64_t bytes_sent = 0;  // to other ranks (read sharing)
  // The whole job's figures, the same on every rank (with read_sharing kReadOnce or kAuto; 0
  // otherwise): bytes read from storage by all ranks, the union of the checkpoint bytes the
  // ranks needed (tensor bytes as stored, and the objects asked for; exact for replicas and
  // disjoint slices, see plan/read_once.h), and bytes sent between ranks.
  uint64_t job_bytes_read = 0;
  uint64_t job_bytes_needed = 0;
  uint64_t job_bytes_exchanged = 0;
  // Bytes of tensor data and objects in the checkpoint (its index).
  uint64_t checkpoint_bytes = 0;
  // How the ranks shared reads: LoadOptions::read_sharing, with kAuto resolved to kReadOnce or
  // kNone (the same on every rank).
  ReadSharing read_sharing = ReadSharing::kNone;
};

Result<SaveReport> Save(const StateDict& state, const std::string& path, Comm& comm,
                        const SaveOptions& options = {});
Result<SaveReport> Save(const StateDict& state, const std::string& path,
                        const SaveOptions& options = {});

// Fills every tensor and object of `state` from the checkpoint at `path`. Tensors may ask for
// any box of the saved global tensor, whatever boxes were saved. Errors name the key, the box,
// the file.
Result<LoadReport> Load(StateDict& state, const std::string& path, Comm& comm,
                        const LoadOptions& options = {});
Result<LoadReport> Load(StateDict& state, const std::string& path, const LoadOptions& options = {});

// Reads and checks the index of the checkpoint at `path`, in any format tessera reads (its
// own, PyTorch DCP / Megatron torch_dist, Hugging Face safetensors: detected from the files;
// `path` may also be one .safetensors file). `storage` null: `path` is a local path or a URI
// (s3://, msc://, file://; see ResolveStorage in storage_uri.h), as for IsCommitted, Finalize and
// Verify below.
Result<Metadata> ReadMetadata(const std::string& path, std::shared_ptr<Storage> storage = nullptr);

// Whether `path` holds a committed checkpoint that is whole, cheaply: its index reads and
// passes every check ReadMetadata makes (for a rank-local save: every rank's part is there), and
// every data file the index lists is present with the size it records. No data byte is read
// (Verify reads them all). True, with *metadata filled when not null; false when `path` holds
// no committed checkpoint (it does not exist, is empty, holds the files of a save that did not
// commit, or an incomplete rank-local save); an error (kDataLoss, naming the file) when an index
// is there but damaged, or a file it lists is missing or of another size. What
// CheckpointManager decides "committed" by; it never looks at the names of the index files.
Result<bool> IsCommitted(const std::string& path, std::shared_ptr<Storage> storage = nullptr,
                         Metadata* metadata = nullptr);

struct VerifyReport {
  uint64_t chunks_checked = 0;  // chunks and objects
  uint64_t bytes_checked = 0;   // bytes whose checksums were checked
  int files_checked = 0;
  CheckpointFormat format = CheckpointFormat::kTessera;
  // False for formats that store no checksums (PyTorch DCP, Hugging Face): Verify then checks
  // structure only (files, sizes, headers, coverage), not the bytes.
  bool checksums = true;
};

// Merges the rank manifests of the rank-local save at `path` (the newest complete one, as
// ReadMetadata chooses) into one manifest, published atomically in the place of the save's
// reference (the same commit number: the save keeps its place among the saves around it),
// and removes the rank manifests and the files of earlier saves. Not collective: run it from
// one process. Returns the merged metadata. Errors as ReadMetadata's (naming the ranks whose
// manifest is missing, or the keys with gaps); kFailedPrecondition when `path` holds no rank-local
// save to finalize. Safe to run beside training: rank-local saves newer than the one it merges
// stay. Run again after a crash, it finishes the job (removes the parts its commit left).
Result<Metadata> Finalize(const std::string& path, std::shared_ptr<Storage> storage = nullptr);

struct VerifyOptions {
  // Data files checked at once, each by one thread, each read sequentially.
  int num_threads = 2;
  // Called with the bytes checked so far and the bytes to check (VerifyReport::bytes_checked
  // once done; 0 for formats without checksums), from one thread (the calling one), every
  // 100 ms while files are checked and once at the end (done == total). Default none.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // Where the files are; null: `path` is a local path or a URI (s3://, msc://, file://).
  std::shared_ptr<Storage> storage = nullptr;
};

// Re-reads every chunk and object, checks checksums (where the format has them; see
// VerifyReport::checksums), file sizes, and that every tensor's chunks cover it exactly. The first
// problem found is returned, naming key, chunk and file (with several threads: the problem of the
// first file, in manifest order, that has one).
Result<VerifyReport> Verify(const std::string& path, const VerifyOptions& options);
Result<VerifyReport> Verify(const std::string& path, std::shared_ptr<Storage> storage = nullptr);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_H_
