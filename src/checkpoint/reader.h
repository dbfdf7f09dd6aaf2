// Reading a committed checkpoint: the manifest, planned runs, objects.
#ifndef TESSERA_CHECKPOINT_READER_H_
#define TESSERA_CHECKPOINT_READER_H_

#include <string>
#include <vector>

#include "checkpoint/device_uploads.h"
#include "checkpoint/progress.h"
#include "format/data_file_headers.h"
#include "plan/load_plan.h"
#include "tessera/checkpoint.h"

namespace tessera {

// Performs `runs` with options.num_io_threads threads, checking the checksum of every run that
// covers a whole chunk when options.verify_checksums. Opens each file once and checks its size
// against the manifest, and, with `headers` (when the format's data files are safetensors
// files), that its header describes every chunk read from it as the manifest does (what Verify
// checks of the file). Errors name the key, the chunk, the file. With a `progress` meter,
// counts the bytes of `runs` as they land and reports from the calling thread. Runs of the
// tensors `uploads` has in device memory go there through its pinned buffers (each thread
// flushes its own before returning; uploads->Finish() waits for the copies).
Status ExecuteReads(Storage& storage, const std::string& dir, const Metadata& metadata,
                    const std::vector<ReadRun>& runs, const LoadOptions& options,
                    LoadReport& report, DataFileHeaders* headers, ProgressMeter* progress = nullptr,
                    DeviceUploads* uploads = nullptr);

// Performs copies of parts of chunks stored in another dimension order: reads each chunk
// whole (checking its checksum blocks when options.verify_checksums and the format has them),
// then copies the part element by element (into device memory through `uploads`, as
// ExecuteReads). `headers` as for ExecuteReads.
Status ExecutePermutedCopies(Storage& storage, const std::string& dir, const Metadata& metadata,
                             const std::vector<PermutedCopy>& copies, const LoadOptions& options,
                             LoadReport& report, DataFileHeaders* headers,
                             DeviceUploads* uploads = nullptr);

// Reads one object's bytes into `out`, checking its checksum when options.verify_checksums and,
// with `headers`, that its file's header describes it.
Status ReadObject(Storage& storage, const std::string& dir, const Metadata& metadata,
                  const ObjectInfo& object, const LoadOptions& options, std::vector<uint8_t>& out,
                  LoadReport& report, DataFileHeaders* headers);

// How many of a data file's first bytes OpenDataFile asks the store to fetch with the open,
// for formats whose data files have headers (Storage::NewReadableFileWithPrefix): a safetensors
// header of up to about 500 entries. Kept in memory while the file is open.
inline constexpr size_t kDataFileHeadPrefixBytes = 64u << 10;

// Opens a data file of the manifest, checking that it exists and has the recorded size.
// `needed_by` names what needs it, for the error message.
Result<std::unique_ptr<ReadableFile>> OpenDataFile(Storage& storage, const std::string& dir,
                                                   const Metadata& metadata, uint32_t file_index,
                                                   const std::string& needed_by);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_READER_H_
