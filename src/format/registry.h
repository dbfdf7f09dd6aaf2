// The registry's internal part: how tessera matches a directory or a file to a format, and
// FormatOf for ids a codec set. The table itself (registry.cc) and what a user sees of it
// (RegisteredFormats, FindFormat, ScopedFormatRegistration) are tessera/format_registry.h.
// Adding a format is one module under src/format/<name>/ and one line in the table
// (docs/DESIGN.md, "Adding a format").
#ifndef TESSERA_SRC_FORMAT_REGISTRY_H_
#define TESSERA_SRC_FORMAT_REGISTRY_H_

#include <string>
#include <string_view>
#include <vector>

#include "tessera/format.h"
#include "tessera/format_registry.h"

namespace tessera {

// The format of `id`, which must be registered: an id a codec set (Metadata::format as read).
// Every CheckpointFormat enumerator is (registry_test checks each); a value outside the enum
// gets the first format, so an id that comes from a user goes through FindFormat instead.
const Format& FormatOf(CheckpointFormat id);

// How the formats share a directory whose sorted entries are `sorted_names`:
//   - `committed`: the formats that found a commit file, in registry order. The first reads
//     the directory; when it finds no complete checkpoint (kFailedPrecondition) the next one
//     does (incomplete rank-local saves beside a PyTorch DCP checkpoint do not hide it);
//   - otherwise `unfinished`: the first format with files of a save that never committed. A
//     format without commit files (kData) does not make a checkpoint of another format's
//     leftovers (a tessera save that died wrote .safetensors data files);
//   - otherwise `data`: the first format whose data files alone are a checkpoint.
struct FormatChoice {
  std::vector<const Format*> committed;
  const Format* unfinished = nullptr;
  const Format* data = nullptr;
  // The format that decides what the directory is: committed.front(), else unfinished, else
  // data; null when no format claims it.
  const Format* primary() const;
  // What primary() claimed (kNone when null), so no caller claims again.
  DirectoryClaim primary_claim() const;
};
FormatChoice ChooseFormats(const std::vector<std::string>& sorted_names);

// Whether `format` is one of tessera's own codecs (the table in registry.cc), whose readers
// validate what they read themselves; false for a format registered from outside
// (ScopedFormatRegistration: a user's format, raw_dir).
bool IsBuiltInFormat(const Format& format);

// The format that claims a path to one file (Format::ClaimsFile), or null.
const Format* FormatOfFile(std::string_view file_name);

}  // namespace tessera

#endif  // TESSERA_SRC_FORMAT_REGISTRY_H_
