// The job-wide read-once load (LoadOptions::read_sharing = kReadOnce): plan/read_once.h's plan,
// carried out. See docs/DESIGN.md, "Load protocol".
#ifndef TESSERA_CHECKPOINT_READ_ONCE_LOAD_H_
#define TESSERA_CHECKPOINT_READ_ONCE_LOAD_H_

#include <string>
#include <vector>

#include "checkpoint/device_uploads.h"
#include "checkpoint/progress.h"
#include "format/data_file_headers.h"
#include "plan/load_plan.h"
#include "tessera/checkpoint.h"
#include "tessera/comm.h"

namespace tessera {

// Reads `runs` (this rank's, sorted by file and offset) so that every cell of the checkpoint
// that any rank needs is read from storage by one rank and checked once:
//   1. each rank describes its needs as cells of chunks (plan/read_once.h); ranks with the same
//      description (replicas) are found by an all-gather of 24 bytes each (a 128-bit hash and
//      options::exchange_bytes, which must agree), and one rank per group sends its list in a
//      second all-gather;
//   2. every rank computes the same plan: for each cell needed by two or more ranks, one reader
//      among them; cells needed by one rank only are read by it through ExecuteReads;
//   3. in rounds of at most options.exchange_bytes per rank, each reader reads its pieces
//      (checking each checksum block, or a whole chunk in order), puts its own bytes in place,
//      and sends each other rank the pieces it needs, by one Comm::Scatter per sending rank.
// A rank that fails (storage, checksum, a device copy) keeps taking part in every round,
// sending nothing; at the end every rank returns the same error: the first failing rank's read
// error, else the exchange's. A failing collective returns at once. Adds this rank's reads,
// sends and receipts to `report`, and the union of the job's needed bytes to
// report.job_bytes_needed. With options.read_sharing kAuto, when every rank reads a local
// filesystem (or no cell is shared), every rank reads its runs itself instead, and
// report.read_sharing says which it did. COLLECTIVE over `comm` (with one rank: the plain read,
// planned for the report).
Status ReadOnceAcrossJob(Comm& comm, Storage& storage, const std::string& dir,
                         const Metadata& metadata, const std::vector<ReadRun>& runs,
                         const LoadOptions& options, LoadReport& report, DataFileHeaders* headers,
                         ProgressMeter& progress, DeviceUploads* uploads);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_READ_ONCE_LOAD_H_
