// tessera bench io --storage: the raw baseline and the run's cleanup on a Storage (an object
// store, through the same client tessera's save and load use), where bench io otherwise works
// on local files with pwrite/pread.
#ifndef TESSERA_TOOLS_BENCH_IO_STORAGE_H_
#define TESSERA_TOOLS_BENCH_IO_STORAGE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera::tools {

// A run of bytes in a rank's memory.
struct Segment {
  std::byte* data;
  uint64_t size;
};

// Writes the concatenation of `segments` as the file `path` of `storage` (created or
// replaced), front to back: on S3 one PUT, or a multipart upload of the client's part size
// with its parts in flight together.
Status StorageRawWrite(Storage& storage, const std::string& path,
                       const std::vector<Segment>& segments);
// Reads the file `path` of `storage` back into `segments`: on a store where each read is a
// request (coalesce_read_bytes), small segments together in reads of that size, larger ones
// as ranged GETs of the client's read size in parallel; elsewhere one ReadAt per segment.
Status StorageRawRead(Storage& storage, const std::string& path,
                      const std::vector<Segment>& segments);
// Removes `dir` and everything under it (files and directories, depth first), ignoring what is
// gone already. Returns the first other error.
Status RemoveStorageTree(Storage& storage, const std::string& dir);
// "tessera-bench-io-" and 16 random hex digits: a run's directory name, new in any prefix.
std::string NewBenchRunName();

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_BENCH_IO_STORAGE_H_
