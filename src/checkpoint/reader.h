// Reading a committed checkpoint: the manifest, planned runs, objects.
#ifndef TESSERA_CHECKPOINT_READER_H_
#define TESSERA_CHECKPOINT_READER_H_

#include <string>
#include <vector>

#include "plan/load_plan.h"
#include "tessera/checkpoint.h"

namespace tessera {

// The manifest's bytes. Errors: the directory does not exist (kNotFound), exists without a
// manifest (kFailedPrecondition, "holds no committed checkpoint"), cannot be read (kIOError),
// has a size other than its header declares, over kMaxManifestBytes, or a checksum that does
// not match (kDataLoss, as DecodeManifest would say). Memory: a small buffer until all of that
// is checked, then the manifest's size.
Result<Bytes> ReadManifestBytes(Storage& storage, const std::string& dir);

// Performs `runs` with options.num_io_threads threads, checking the checksum of every run that
// covers a whole chunk when options.verify_checksums. Opens each file once and checks its size
// against the manifest. Errors name the key, the chunk, the file.
Status ExecuteReads(Storage& storage, const std::string& dir, const Metadata& metadata,
                    const std::vector<ReadRun>& runs, const LoadOptions& options,
                    LoadReport& report);

// Reads one object's bytes into `out`, checking its checksum when options.verify_checksums.
Status ReadObject(Storage& storage, const std::string& dir, const Metadata& metadata,
                  const ObjectInfo& object, const LoadOptions& options, std::vector<uint8_t>& out,
                  LoadReport& report);

// Opens a data file of the manifest, checking that it exists and has the recorded size.
// `needed_by` names what needs it, for the error message.
Result<std::unique_ptr<ReadableFile>> OpenDataFile(Storage& storage, const std::string& dir,
                                                   const Metadata& metadata, uint32_t file_index,
                                                   const std::string& needed_by);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_READER_H_
