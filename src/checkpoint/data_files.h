// Step 3 of a save on one rank: writing its data files (docs/FORMAT.md, sections 2 and 4), in
// any format: the one write engine. A format's codec (tessera/format_writer.h) names the files,
// lays out their headers and frames each item; the engine does the rest (threads, device
// staging, progress, writeback, checksums, removing what a failed save created).
#ifndef TESSERA_CHECKPOINT_DATA_FILES_H_
#define TESSERA_CHECKPOINT_DATA_FILES_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "plan/save_plan.h"
#include "tessera/checkpoint.h"
#include "tessera/format_writer.h"
#include "tessera/state_dict.h"
#include "tessera/storage.h"

namespace tessera {

// The bytes of one local item, where they lie in the caller's state.
const std::byte* ItemData(const StateDict& state, const LocalItem& item);

// Which of the rank's items go into which of its data files, and in what order.
// Items smaller than this are placed together at the start of their data file.
inline constexpr uint64_t kSmallItemBytes = 1u << 20;

struct DataFilePlan {
  std::string name;
  std::vector<uint32_t> items;  // indices into the local plan, in file order
};

// Splits `items` (indices into `plan`) over data files: one group of files for the items whose
// key starts with each of `separate_prefixes` (the longest matching prefix wins), one for the
// rest; each group over up to `files_per_group` files, balancing bytes (largest first to the
// least loaded); or, when the format stores one item per file (FormatWriter::OneFilePerItem),
// each item in a file of its own. Within a file, items of fewer than kSmallItemBytes come first,
// then the others; each part in the manifest's order (tensors by key and box, then objects by
// key), which its encoding rewards (docs/FORMAT.md, section 3.5). Small items side by side let a
// rank that needs many of them (the norms and biases one rank saved for all) fetch them in few
// requests where each read is one (CoalescingFile). Files are named
// writer.DataFileName(save_id, rank, f, attempt).
// The data files (and I/O threads) of each rank for SaveOptions::num_io_threads = `requested`
// on `storage`: `requested` when it is at least 1; for 0, 2 on a store with positional writes
// (a file system, memory) and 1 on one without (an object store, where one file's parts upload
// in parallel and a second file would only add its create and completion requests).
int SaveIoThreads(int requested, const Storage& storage);

std::vector<DataFilePlan> PlanDataFiles(const LocalPlan& plan, const std::vector<uint32_t>& items,
                                        int files_per_group,
                                        const std::vector<std::string>& separate_prefixes,
                                        const FormatWriter& writer, const std::string& save_id,
                                        int rank, const std::string& attempt = "");

struct DataFileWriteOptions {
  int num_threads = 2;  // files written at once
  SyncPolicy sync = SyncPolicy::kFull;
  // Checksum block size of tensor chunks (Metadata::checksum_block_bytes); objects get one
  // checksum whatever their size.
  uint64_t checksum_block_bytes = 0;
  // Called with the bytes written so far by this rank, from the calling thread only.
  std::function<void(uint64_t done)> on_progress;
  // How tensors in device memory are copied to host memory (checkpoint/item_source.h).
  DeviceStagingOptions device_staging;
};

// Bytes written per WriteAt, and (with SyncPolicy::kFull) between StartWriteback calls, by the
// data file writers of every format (the reasons are in data_files.cc).
inline constexpr uint64_t kWritePiece = 256u << 10;
inline constexpr uint64_t kWritebackStep = 8u << 20;

// The threads of a rank's data file writers, for any format: runs write_file(f, created[f]) for
// every f in [0, files.size()) on up to options.num_threads threads. With options.on_progress
// the calling thread only reports `written` (which write_file advances) every 100 ms and once at
// the end; otherwise it writes too. write_file sets `created` once it created its file. When any
// file fails, removes every file created (never a name that was already taken: that belongs to
// someone else) and returns the first failure in file order, prefixed "writing <dir>/<name>".
Status WriteFilesInParallel(Storage& storage, const std::string& dir,
                            const std::vector<DataFilePlan>& files,
                            const DataFileWriteOptions& options, std::atomic<uint64_t>& written,
                            const std::function<Status(size_t f, uint8_t& created)>& write_file);

class ItemSource;

// WriteFilesInParallel with the items' bytes coming from an ItemSource made for the call
// (checkpoint/item_source.h): write_file(source, f, created) reads the items of file f through
// it, in file order. Calls options.device_staging.on_staged (ItemSource).
Status WriteFilesFromSource(
    Storage& storage, const std::string& dir, const StateDict& state, const LocalPlan& plan,
    const std::vector<DataFilePlan>& files, const DataFileWriteOptions& options,
    std::atomic<uint64_t>& written,
    const std::function<Status(ItemSource& source, size_t f, uint8_t& created)>& write_file);

// Writes the planned files of save `save_id` in `writer`'s format with up to
// options.num_threads threads, and reports where every item landed (WrittenItem: the item's
// offset and stored length, framing included). Lays every file out (FormatWriter::NewDataFile)
// before writing any, so what the codec refuses leaves nothing behind. When the codec asks for
// them (EngineChecksums), checksums every piece right after writing it (one per block of
// options.checksum_block_bytes; one per object); otherwise reports none. Items in device memory
// are copied to pinned host memory piece by piece as the writers go (ItemSource), and
// options.device_staging.on_staged is called once they all were (or will not be). On failure
// removes every file it created and returns the first error, naming the file.
Result<WriteResult> WriteDataFiles(Storage& storage, const std::string& dir, const StateDict& state,
                                   const LocalPlan& plan, const std::vector<DataFilePlan>& files,
                                   const FormatWriter& writer, const std::string& save_id,
                                   const DataFileWriteOptions& options);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_DATA_FILES_H_
