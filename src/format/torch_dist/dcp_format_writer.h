// The write side of PyTorch DCP (docs/FORMAT_TORCH_DIST.md, "What tessera writes"): data files
// named DcpDataFileName, no file header, every tensor chunk one torch.save item streamed with its
// zip CRC-32, every object the byte item of its ObjectEncoding, back to back; one `.metadata`
// (the pickle ToDcpMetadata describes) that each commit replaces.
#ifndef TESSERA_FORMAT_TORCH_DIST_DCP_FORMAT_WRITER_H_
#define TESSERA_FORMAT_TORCH_DIST_DCP_FORMAT_WRITER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "format/torch_dist/dcp_metadata.h"
#include "tessera/checkpoint.h"
#include "tessera/format_writer.h"

namespace tessera::torch_dist {

// The flavour of `.metadata` TorchDistOptions::flavor names.
DcpFlavor DcpFlavorOf(TorchDistFlavor flavor);

// The TorchDistOptions of a save or conversion: those `format_options` holds, else the ones
// the deprecated fields of `owner` ("SaveOptions", "ConvertOptions") give: `flavor` (its
// torch_dist_flavor) and `key_paths` (SaveOptions::torch_dist_key_paths; null for none).
// BadOption naming the deprecated field when it is set beside TorchDistOptions.
Result<TorchDistOptions> ResolveTorchDistOptions(
    const FormatOptions& format_options, TorchDistFlavor flavor,
    const std::map<std::string, std::vector<TorchDistPathElement>>* key_paths,
    const std::string& owner);

// Refuses a directory whose entries (`names`) include a tessera commit (a numbered manifest or
// the version 2 one): it would hide the DCP checkpoint from tessera's readers, which look for
// it first. FailedPrecondition naming it.
Status CheckDcpSaveTarget(const std::string& dir, const std::vector<std::string>& names);

// The writer of a save with `options` (format torch_dist). BadOption for user_metadata on the
// coordinator (the one saved): DCP has no place for it. Its NewDataFile refuses, naming the key,
// a chunk whose dtype torch 1.13 lacks when the flavour is kTorch113.
// The bytes of `dcp` as the `.metadata` at `path`, once they read back (ReadDcpMetadata) equal
// to `dcp` as the reader links it; DataLoss naming `path` otherwise.
Result<Bytes> EncodeCheckedDcpMetadata(const DcpMetadata& dcp, const std::string& path);

Result<std::unique_ptr<FormatWriter>> NewDcpWriter(const SaveOptions& options, bool coordinator);

}  // namespace tessera::torch_dist

#endif  // TESSERA_FORMAT_TORCH_DIST_DCP_FORMAT_WRITER_H_
