// Conversion planning (tessera convert): which tensors and objects of a checkpoint go to the
// output, under which names and dtypes, in which output files, written by which rank, and in
// which units of work. Pure and deterministic: every rank computes the same plan from the same
// Metadata and options, with no I/O and no communication.
//
// A unit is a contiguous byte range of one output file's data section: a run of whole tensors
// and parts of tensors, as they lie back to back in the file. A converting thread loads the
// unit's pieces from the source (a flat element range of each tensor), converts their dtype
// when asked, and writes the unit with one write. Units bound the memory a conversion holds.
#ifndef TESSERA_PLAN_CONVERT_PLAN_H_
#define TESSERA_PLAN_CONVERT_PLAN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/dtype.h"
#include "tessera/metadata.h"
#include "tessera/status.h"

namespace tessera {

struct ConvertPlanOptions {
  // The output format's name, for messages (Format::name: planning knows no registry).
  std::string format_name = "tessera";
  // Objects are exported only to formats that can hold them (tessera); otherwise they are
  // listed in ConvertPlan::skipped_objects.
  bool keep_objects = false;
  // Output files hold at most this many data bytes, unless one tensor alone is larger (it
  // then has a file of its own). Must be > 0.
  uint64_t max_file_bytes = 5'000'000'000;
  // Every tensor and object in a file of its own, whatever its size (a format that stores one
  // item per file: FormatWriter::OneFilePerItem).
  bool one_item_per_file = false;
  // Keep only keys starting with one of these (all when empty).
  std::vector<std::string> key_prefixes;
  // Removed from the start of every key that has it.
  std::string strip_prefix;
  // F64/F32/F16/BF16 tensors become this dtype (must be one of those four); others keep theirs.
  std::optional<DType> dtype;
  int num_ranks = 1;  // output files are spread over this many writers
};

struct OutputTensor {
  uint32_t source = 0;  // index into Metadata::tensors
  std::string name;     // key in the output
  DType source_dtype = DType::kF32;
  DType dtype = DType::kF32;  // in the output
  Shape shape;
  uint64_t bytes = 0;   // in the output
  uint32_t file = 0;    // index into ConvertPlan::files
  uint64_t offset = 0;  // in the file's data section
};

struct OutputObject {
  uint32_t source = 0;  // index into Metadata::objects
  std::string name;
  uint64_t bytes = 0;
  uint32_t file = 0;
  uint64_t offset = 0;  // in the file's data section, after the file's tensors
};

struct OutputFile {
  std::vector<uint32_t> tensors;  // indices into ConvertPlan::tensors, in file order
  std::vector<uint32_t> objects;  // indices into ConvertPlan::objects, after the tensors
  uint64_t data_bytes = 0;
  int rank = 0;  // the rank that writes it
};

struct ConvertPlan {
  std::vector<OutputTensor> tensors;         // sorted by name
  std::vector<OutputObject> objects;         // sorted by name
  std::vector<OutputFile> files;             // in name order of the output (file 0 first)
  std::vector<std::string> skipped_objects;  // source keys of objects not exported
  uint64_t total_tensor_bytes = 0;           // of the output tensors
};

// Filters, renames and lays out the output. Errors (InvalidArgument) name the keys: two keys
// that become one name, a key that becomes empty, nothing left to export, a target dtype that
// is not a float.
Result<ConvertPlan> PlanConversion(const Metadata& metadata, const ConvertPlanOptions& options);

// One tensor's part of a unit: the elements [begin, end) of its row-major flattening.
struct UnitPiece {
  uint32_t tensor = 0;  // index into ConvertPlan::tensors
  int64_t begin = 0;    // elements
  int64_t end = 0;
  uint64_t out_offset = 0;  // bytes into the unit's output buffer
  uint64_t src_offset = 0;  // bytes into the unit's source buffer (converted pieces only)
  bool converted = false;   // dtype changes: loaded into the source buffer, then converted
};

struct ConvertUnit {
  uint32_t file = 0;
  uint64_t offset = 0;     // in the file's data section
  uint64_t out_bytes = 0;  // output bytes (the write)
  uint64_t src_bytes = 0;  // source buffer bytes needed (0 when nothing converts)
  std::vector<UnitPiece> pieces;
};

// The units of every file `rank` writes, in file and offset order. Each unit needs at most
// `unit_bytes` of output buffer and at most `unit_bytes` of source buffer; a tensor is cut
// only at multiples of `block_bytes` of its output bytes (so that checksum blocks, which
// start at each tensor's first byte, never straddle two units). `unit_bytes` is raised to
// 4 * block_bytes when smaller. Tensors without elements get no piece.
std::vector<ConvertUnit> PlanUnits(const ConvertPlan& plan, int rank, uint64_t unit_bytes,
                                   uint64_t block_bytes);

}  // namespace tessera

#endif  // TESSERA_PLAN_CONVERT_PLAN_H_
