// tessera's own format as a Format (docs/FORMAT.md): numbered commits, rank-local saves merged
// from their rank manifests, and the version 2 directories before them.
#ifndef TESSERA_FORMAT_TESSERA_TESSERA_FORMAT_H_
#define TESSERA_FORMAT_TESSERA_TESSERA_FORMAT_H_

#include <string>

#include "tessera/format.h"

namespace tessera {

// The codec the registry lists.
const Format& TesseraFormat();

// The commit `name` ("tessera.manifest.<n>" or the version 2 "tessera.manifest") of `dir`: a
// whole manifest or a reference, its number checked against its name. Reads nothing it has not
// bounded first (the size its header declares, at most kMaxManifestBytes, then its checksum).
Result<Metadata> ReadCommit(Storage& storage, const std::string& dir, const std::string& name);

// `metadata` (another format's index) held to every rule of a tessera manifest
// (docs/FORMAT.md, 3.3) by encoding and decoding it (EncodeCarriedIndex, which is also how it
// travels between ranks: any registered format's id passes); format_version 0 (no tessera
// version). `what` prefixes errors.
Result<Metadata> CheckAsManifest(const Metadata& metadata, const std::string& what);

}  // namespace tessera

#endif  // TESSERA_FORMAT_TESSERA_TESSERA_FORMAT_H_
