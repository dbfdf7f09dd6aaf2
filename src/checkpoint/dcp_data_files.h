// Step 3 of a save with SaveFormat::kTorchDist on one rank: its PyTorch DCP data files
// (docs/FORMAT_TORCH_DIST.md, "What tessera writes"). The same plan, threads, progress and
// cleanup as tessera's own data files (data_files.h); only the bytes differ: every chunk is one
// torch.save item, every object a byte item, back to back, no file header.
#ifndef TESSERA_CHECKPOINT_DCP_DATA_FILES_H_
#define TESSERA_CHECKPOINT_DCP_DATA_FILES_H_

#include <string>
#include <vector>

#include "checkpoint/data_files.h"
#include "format/torch_dist/dcp_metadata.h"
#include "plan/save_plan.h"
#include "tessera/state_dict.h"
#include "tessera/storage.h"

namespace tessera {

// PlanDataFiles's split and order, with DCP data file names
// (torch_dist::DcpDataFileName(save_id, rank, f)).
std::vector<DataFilePlan> PlanDcpDataFiles(const LocalPlan& plan,
                                           const std::vector<uint32_t>& items, int files_per_group,
                                           const std::vector<std::string>& separate_prefixes,
                                           const std::string& save_id, int rank);

// Writes the planned files with up to options.num_threads threads: each tensor chunk streamed as
// a torch.save item in pieces of kWritePiece (its zip CRC-32 computed as it goes), each object
// as the byte item of its ObjectEncoding (torch_dist::WriteDcpObjectItem). Reports every item's
// location: the whole item (WrittenItem::length is the item's size; checksum 0). Before writing
// anything, InvalidArgument naming the key when `flavor` is torch 1.13 and a chunk's dtype does
// not exist there. options.checksum_block_bytes is ignored (DCP has no checksums). On failure
// removes every file it created and returns the first error, naming the file.
Result<WriteResult> WriteDcpDataFiles(Storage& storage, const std::string& dir,
                                      const StateDict& state, const LocalPlan& plan,
                                      const std::vector<DataFilePlan>& files,
                                      torch_dist::DcpFlavor flavor,
                                      const DataFileWriteOptions& options);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_DCP_DATA_FILES_H_
