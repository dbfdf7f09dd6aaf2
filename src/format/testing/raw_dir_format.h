// raw_dir: a fourth format, for tests only (issue 31, step 5). It proves that a format plugs in
// with its module and one line: the tests that use it register it for their duration
// (ScopedFormatRegistration in tessera/format_registry.h), and it is compiled into the tests only
// (src/format/testing/ is no part of the library).
//
// A checkpoint is a directory of raw files, one per tensor chunk and one per object, each the
// item's bytes alone (a chunk's elements row-major, little-endian), named after the save that
// wrote them ("raw_dir-<save id>-r<rank>-f<n>.bin"), and one JSON index, "raw_dir.index.json",
// which each commit replaces (as DCP's .metadata: numbered commits are the tessera manifest's
// own protocol, FormatWriter::NumberedCommits). The index is one JSON
// object:
//   {"xxh3":"<16 hex digits>","index":{...}}
// byte for byte in that order, the digits the XXH3-64 of the bytes of the "index" value as they
// are in the file, so that any damage to the index is an error naming it. The "index" value
// holds the save id, the ranks, the save time, the checksum kind and block size, the user
// metadata, the separate prefixes, the files (name, size), the tensors (key, dtype, shape,
// partial, and per chunk its box, its file and the XXH3-64 of each of its blocks, as tessera
// checksums them) and the objects (key, encoding, file, length, checksum).
#ifndef TESSERA_FORMAT_TESTING_RAW_DIR_FORMAT_H_
#define TESSERA_FORMAT_TESTING_RAW_DIR_FORMAT_H_

#include "tessera/format.h"

namespace tessera::testing {

// The id raw_dir takes: a value outside CheckpointFormat's enumerators.
inline constexpr CheckpointFormat kRawDirFormatId = static_cast<CheckpointFormat>(100);
inline constexpr char kRawDirIndexName[] = "raw_dir.index.json";

// The codec; register it with ScopedFormatRegistration before using it.
const Format& RawDirFormat();

}  // namespace tessera::testing

#endif  // TESSERA_FORMAT_TESTING_RAW_DIR_FORMAT_H_
