// The Format conformance suite (issue 31, step 6): the cases every registered format must pass,
// run on each (src/checkpoint/format_suite_test.cc instantiates them). It lives beside the
// multi-rank suite because it drives the front doors (Save, Load, Convert, Verify) over a
// format, which the format layer itself cannot call.
//
// Each case writes checkpoints in the format the way tessera produces it: Save for a format it
// saves (Format::CanWrite), and otherwise (Hugging Face safetensors) a tessera checkpoint saved
// beside it and converted (Convert). It then checks:
//   - RoundTrip: save then load gives back equal bytes, in several dtypes (bf16 among them), a
//     0-d and an empty tensor, objects and user metadata where the format stores them;
//     ReadMetadata says the format;
//   - Reshard2To3: written from 2 ranks (rows, columns, several pieces on one rank, flat
//     ranges, replicas), loaded on 3 ranks as other boxes and flat ranges;
//   - ConvertBothWays: the format converted into tessera, and tessera into the format, load
//     the same values;
//   - VerifyNamesAFlippedDataByte (formats with checksums of their data): Verify passes, then
//     fails naming the data file once one byte of it is flipped, and so does a load;
//   - ACrashAtEveryStorageOperation: a crash (what was not durable is lost) at each storage
//     operation in turn of a save over a previous checkpoint (of a conversion into a fresh
//     directory, for a format tessera does not save) leaves a directory that loads as the old
//     checkpoint (none) or the new one, nothing else; a save that ran to the end removed the
//     old checkpoint's data files;
//   - ATruncatedIndexIsAnErrorNamingIt: the index cut short is an error naming its file;
//   - AFlippedIndexByteIsAnErrorNamingIt (formats whose index carries a checksum): each byte
//     of the index flipped in turn is an error naming it;
//   - AFlippedIndexByteNeverLoadsWrongTensors: each byte of the index flipped in turn makes a
//     read or a load fail, or load exactly the saved tensors; never a crash;
//   - AFlippedIndexByteNeverLoadsWrongObjects (formats whose objects carry checksums): the
//     same for the objects. PyTorch DCP's byte items may be raw bytes (torch writes BytesIO
//     items so) with nothing to check: a damaged .metadata that moves one loads other bytes.
// A case that does not apply to a format (FormatCase::applies) is absent from its
// instantiation, never a passing no-op.
#ifndef TESSERA_SUITE_FORMAT_SUITE_H_
#define TESSERA_SUITE_FORMAT_SUITE_H_

#include <functional>
#include <string>
#include <vector>

#include "tessera/format.h"
#include "tessera/status.h"

namespace tessera::suite {

// A format as the suite runs it.
struct FormatUnderTest {
  const Format* format = nullptr;
  // A test-only format: registered for each case (ScopedFormatRegistration, format/registry.h)
  // and removed after it.
  bool register_for_test = false;
  // Whether the index carries a checksum of its own, so that any damage to it is detected
  // (tessera's manifest, raw_dir's index; DCP's .metadata and Hugging Face's index JSON have
  // none). The one capability a format declares; the others the suite asks the format.
  bool index_checksum = false;
};

// What a format can do, as the cases need to know it.
struct FormatCapabilities {
  bool saves = false;             // Format::CanWrite: Save writes it; else Convert from tessera
  bool objects = false;           // FormatWriter::StoresObjects
  bool user_metadata = false;     // FormatWriter::StoresUserMetadata
  bool data_checksums = false;    // FormatWriter::EngineChecksums or a FramingChecksum
  bool object_checksums = false;  // FormatWriter::EngineChecksums: every object's bytes too
  bool index_checksum = false;    // FormatUnderTest::index_checksum
};
FormatCapabilities CapabilitiesOf(const FormatUnderTest& format);

struct FormatCase {
  std::string name;
  // Whether the case applies to a format that can do this.
  std::function<bool(const FormatCapabilities&)> applies;
  // Runs the case; errors say what failed. The format is registered when it must be.
  std::function<Status(const FormatUnderTest&)> run;
};

// Every case, in a fixed order.
const std::vector<FormatCase>& FormatCases();

// Runs `test_case` on `format`, registering a test-only format for its duration.
Status RunFormatCase(const FormatCase& test_case, const FormatUnderTest& format);

}  // namespace tessera::suite

#endif  // TESSERA_SUITE_FORMAT_SUITE_H_
