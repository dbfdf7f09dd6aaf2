// The registry of checkpoint formats, as a user of the format plug-in API (tessera/format.h)
// sees it: the formats tessera reads and writes, found by id or by name, and the registration
// of a format of one's own for the duration of a test (ScopedFormatRegistration), which is how
// a format written outside tessera runs the Format conformance suite
// (tessera/testing/format_suite.h).
//
// tessera's own formats are one explicit table (src/format/registry.cc), as ADIOS2's engine
// factory: a static-registration object in each codec would be dropped by the linker from a
// static library whenever nothing else in its object file is referenced. Adding a format to
// tessera is one module under src/format/<name>/ and one line in the table (docs/DESIGN.md,
// "Adding a format"). How a directory is matched to a format (ChooseFormats) is internal
// (src/format/registry.h).
//
// Thread safety: the lookups read the table without a lock; they are safe from any number of
// threads while no ScopedFormatRegistration is constructed or destroyed (see there).
#ifndef TESSERA_FORMAT_REGISTRY_H_
#define TESSERA_FORMAT_REGISTRY_H_

#include <string>
#include <string_view>
#include <vector>

#include "tessera/format.h"
#include "tessera/formats.h"

namespace tessera {

// Every registered format, in detection order (the order a directory's formats are asked in).
const std::vector<const Format*>& RegisteredFormats();
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

}  // namespace tessera

#endif  // TESSERA_FORMAT_REGISTRY_H_
