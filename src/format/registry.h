// The formats tessera reads and writes, in one explicit table (registry.cc), as ADIOS2's engine
// factory: a static-registration object in each codec would be dropped by the linker from a
// static library whenever nothing else in its object file is referenced. Adding a format is
// one module under src/format/<name>/ and one line in the table (docs/DESIGN.md, "Adding a
// format").
#ifndef TESSERA_FORMAT_REGISTRY_H_
#define TESSERA_FORMAT_REGISTRY_H_

#include <string>
#include <string_view>
#include <vector>

#include "format/format.h"

namespace tessera {

// Every registered format, in detection order (the order ChooseFormats asks them in).
const std::vector<const Format*>& RegisteredFormats();
// The format of `id`, which must be registered: an id a codec set (Metadata::format as read).
// Every CheckpointFormat enumerator is (registry_test checks each); a value outside the enum
// gets the first format, so an id that comes from a user goes through FindFormat instead.
const Format& FormatOf(CheckpointFormat id);
// The format of `id`, or null when none is registered under it (a value outside the enum that
// no test registered).
const Format* FindFormat(CheckpointFormat id);
// The format named `name` (Format::name), or null.
const Format* FindFormat(std::string_view name);
// "tessera, torch_dist, safetensors": the registered names, for messages and option help.
std::string FormatNames();
// The name of the format `id` for messages: the registered format's (Format::name), else
// CheckpointFormatName's ("unknown" for a value outside the enum).
const char* FormatName(CheckpointFormat id);

// For tests only: adds `format` (which must outlive this object) to the end of the registry,
// last in detection order, until this object is destroyed, so that a test-only format plugs in
// with its module and this one line. Its id (a value outside CheckpointFormat's enumerators,
// e.g. static_cast<CheckpointFormat>(100)) and its name must be no registered format's: a
// duplicate aborts. Not thread-safe: construct and destroy it while no other thread uses the
// registry (in a test body or a fixture, never while a save or load runs), so that
// RegisteredFormats() stays a reference to one table, read without a lock.
class ScopedFormatRegistration {
 public:
  explicit ScopedFormatRegistration(const Format& format);
  ~ScopedFormatRegistration();
  ScopedFormatRegistration(const ScopedFormatRegistration&) = delete;
  ScopedFormatRegistration& operator=(const ScopedFormatRegistration&) = delete;

 private:
  const Format* format_;
};

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

// The format that claims a path to one file (Format::ClaimsFile), or null.
const Format* FormatOfFile(std::string_view file_name);

}  // namespace tessera

#endif  // TESSERA_FORMAT_REGISTRY_H_
