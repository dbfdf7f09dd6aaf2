// The Format conformance suite: the cases every checkpoint format must pass, for a format
// (tessera/format.h) to instantiate with one macro. tessera runs it on each of its formats
// (tessera, torch_dist, safetensors) and on raw_dir, a format for tests only
// (src/checkpoint/format_suite_test.cc); a user's own format runs it the same way:
//
//   #include "tessera/testing/format_suite.h"
//
//   // A format of tessera's registry:
//   TESSERA_INSTANTIATE_FORMAT_SUITE(Tessera, *tessera::FindFormat("tessera"),
//                                    .index_checksum = true);
//   // A format of one's own, registered around each case (ScopedFormatRegistration):
//   TESSERA_INSTANTIATE_FORMAT_SUITE(Mine, MyFormat(), .register_for_test = true);
//
// and links GoogleTest's gtest_main (or its own main). The options after the format are the
// fields of FormatSuiteOptions, as designated initializers in their order (or one
// FormatSuiteOptions). The format expression is evaluated once, when the suite is registered
// (at static initialization): make it a function returning a function-local static, as
// tessera's own formats are, not a global of another file. The tests are named
// <Name>/FormatTest.<Case>.
//
// Each case writes checkpoints in the format the way tessera produces it: Save for a format it
// saves (Format::CanWrite), and otherwise (Hugging Face safetensors) a tessera checkpoint saved
// beside it and converted (Convert), all in memory (MemoryStorage) over in-process ranks
// (LocalComm). It then checks:
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
// What a format can do (FormatCapabilities) is asked of the format (CapabilitiesOf), except
// whether its index carries a checksum, which the instantiation declares. A case that does not
// apply to a format is not registered at all: it is absent, never a passing no-op
// (FormatSuiteCaseNames lists what a format runs).
//
// The cases are registered with ::testing::RegisterTest, as the Storage suite's
// (tessera/testing/storage_suite.h), so that this header may be included by any number of
// files of one test program. Header-only: it needs tessera's public headers and GoogleTest,
// nothing else.
#ifndef TESSERA_TESTING_FORMAT_SUITE_H_
#define TESSERA_TESTING_FORMAT_SUITE_H_

#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "tessera/box.h"
#include "tessera/checkpoint.h"
#include "tessera/comm.h"
#include "tessera/convert.h"
#include "tessera/dtype.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/format.h"
#include "tessera/format_registry.h"
#include "tessera/format_writer.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "tessera/metadata.h"
#include "tessera/sharded_tensor.h"
#include "tessera/state_dict.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera::testing {

// How the suite runs a format: what the instantiation declares besides the format.
struct FormatSuiteOptions {
  // A format that is not in the registry (a test-only one, or a user's own): registered for
  // each case (ScopedFormatRegistration, tessera/format_registry.h) and removed after it.
  bool register_for_test = false;
  // Whether the index carries a checksum of its own, so that any damage to it is detected
  // (tessera's manifest; DCP's .metadata and Hugging Face's index JSON have none). The one
  // capability a format declares; the others the suite asks the format.
  bool index_checksum = false;
  // The bytes of an object the suite saves, made from `raw` random bytes. Objects are saved as
  // ObjectEncoding::kTorchSave, the one encoding every format that stores objects gives back
  // byte for byte (PyTorch DCP wraps the others in a torch.save archive of its own). A format
  // that reads into such bytes should be given real ones, so that its checks run: torch_dist
  // checks the zip records of a torch.save archive (their CRC-32s) at every load and Verify,
  // and takes other bytes as a raw BytesIO item with nothing to check; tessera's own test
  // gives it torch.save(bytes(raw)). Null (the default): `raw` itself.
  std::function<std::vector<uint8_t>(std::span<const uint8_t> raw)> make_object_bytes;
};

// A format as the suite runs it.
struct FormatUnderTest {
  const Format* format = nullptr;
  FormatSuiteOptions options;

  // The bytes of an object made from `raw` (FormatSuiteOptions::make_object_bytes).
  std::vector<uint8_t> ObjectBytes(std::span<const uint8_t> raw) const {
    if (options.make_object_bytes) return options.make_object_bytes(raw);
    return std::vector<uint8_t>(raw.begin(), raw.end());
  }
};

// What a format can do, as the cases need to know it.
struct FormatCapabilities {
  bool saves = false;             // Format::CanWrite: Save writes it; else Convert from tessera
  bool objects = false;           // FormatWriter::StoresObjects
  bool user_metadata = false;     // FormatWriter::StoresUserMetadata
  bool data_checksums = false;    // FormatWriter::EngineChecksums or a FramingChecksum
  bool object_checksums = false;  // FormatWriter::EngineChecksums: every object's bytes too
  bool index_checksum = false;    // FormatSuiteOptions::index_checksum
};

// Asks the format (its conversion writer) what it can do.
inline FormatCapabilities CapabilitiesOf(const FormatUnderTest& f) {
  FormatCapabilities caps;
  caps.saves = f.format->CanWrite();
  caps.index_checksum = f.options.index_checksum;
  ConvertOptions options;
  options.to = f.format->id();
  Result<std::unique_ptr<FormatWriter>> writer = f.format->NewConversionWriter(options);
  if (writer.ok()) {
    caps.objects = (*writer)->StoresObjects();
    caps.user_metadata = (*writer)->StoresUserMetadata();
    caps.object_checksums = (*writer)->EngineChecksums();
    caps.data_checksums =
        (*writer)->EngineChecksums() || (*writer)->FramingChecksum() != ChecksumKind::kNone;
  }
  return caps;
}

namespace format_cases {

// `n` bytes that depend on `seed` (splitmix64).
inline std::vector<uint8_t> SuiteBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  uint64_t x = seed;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    for (size_t k = 0; k < 8 && i + k < n; ++k) out[i + k] = static_cast<uint8_t>(z >> (8 * k));
  }
  return out;
}

// Fails unless `condition`; the message says what was expected.
inline Status Expect(bool condition, const std::string& what) {
  return condition ? Status::Ok() : Internal("expectation failed: " + what);
}

// ---- The state: tensors in several dtypes and shapes, objects. --------------------------------

struct TensorSpec {
  std::string key;
  DType dtype;
  Shape shape;
};

inline const std::vector<TensorSpec>& Specs() {
  static const std::vector<TensorSpec> specs = {
      {"a.f32", DType::kF32, {6, 10}},  {"b.bf16", DType::kBF16, {9, 4}},
      {"c.i64", DType::kI64, {12}},     {"d.f16", DType::kF16, {3, 5, 2}},
      {"e.scalar", DType::kF64, {}},    {"f.bool", DType::kBool, {5}},
      {"g.empty", DType::kF32, {0, 4}},
  };
  return specs;
}

// The whole values of a checkpoint: every tensor row-major, every object's bytes (saved as
// ObjectEncoding::kTorchSave, made by FormatSuiteOptions::make_object_bytes).
struct Values {
  std::map<std::string, std::vector<uint8_t>> tensors;
  std::map<std::string, std::vector<uint8_t>> objects;
  std::map<std::string, std::string> user_metadata;
};

inline Values MakeValues(const FormatUnderTest& f, uint64_t seed, const FormatCapabilities& caps) {
  Values v;
  for (const TensorSpec& s : Specs()) {
    const size_t n = static_cast<size_t>(Box::Whole(s.shape).NumElements()) * DTypeSize(s.dtype);
    std::vector<uint8_t> bytes = SuiteBytes(n, seed * 131 + v.tensors.size());
    if (s.dtype == DType::kBool) {
      for (uint8_t& b : bytes) b &= 1;
    }
    v.tensors[s.key] = std::move(bytes);
  }
  if (caps.objects) {
    for (const char* key : {"obj.config", "obj.rng"}) {
      v.objects[key] = f.ObjectBytes(SuiteBytes(24 + v.objects.size(), seed + 7));
    }
  }
  if (caps.user_metadata) v.user_metadata = {{"step", std::to_string(seed)}, {"run", "suite"}};
  return v;
}

// The bytes of `box` of a row-major tensor `whole` of `shape`, elements of `element` bytes.
inline std::vector<uint8_t> Slice(const std::vector<uint8_t>& whole, const Shape& shape,
                                  const Box& box, size_t element) {
  std::vector<uint8_t> out;
  const int64_t count = box.NumElements();
  if (count == 0) return out;
  out.reserve(static_cast<size_t>(count) * element);
  std::vector<int64_t> at(shape.size(), 0);
  for (int64_t i = 0; i < count; ++i) {
    int64_t linear = 0;
    for (size_t d = 0; d < shape.size(); ++d) linear = linear * shape[d] + box.offsets[d] + at[d];
    const auto* p = whole.data() + static_cast<size_t>(linear) * element;
    out.insert(out.end(), p, p + element);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++at[d] < box.sizes[d]) break;
      at[d] = 0;
    }
  }
  return out;
}

// One piece of a tensor a rank holds: a box, or a flat range of the elements of a box.
struct Piece {
  Box box;
  std::optional<FlatRange> flat;
  bool replica = false;
};

inline Box Rows(const Shape& shape, int64_t begin, int64_t end) {
  Box box = Box::Whole(shape);
  box.offsets[0] = begin;
  box.sizes[0] = end - begin;
  return box;
}

// What rank `rank` of `ranks` (1 or 2) holds of `s` when it saves: everything on one rank; on
// two, rows of one tensor, columns of another, two pieces of a third on rank 0, flat ranges of
// a fourth, replicas of the rest.
inline std::vector<Piece> SavePieces(const TensorSpec& s, int rank, int ranks) {
  const Box whole = Box::Whole(s.shape);
  if (ranks == 1) return {Piece{whole}};
  if (s.key == "a.f32") return {Piece{Rows(s.shape, 3 * rank, 3 * rank + 3)}};
  if (s.key == "b.bf16") return {Piece{Box{{0, 2 * rank}, {9, 2}}}};
  if (s.key == "c.i64") {
    if (rank == 0) return {Piece{Box{{0}, {4}}}, Piece{Box{{4}, {2}}}};
    return {Piece{Box{{6}, {6}}}};
  }
  if (s.key == "d.f16") {
    return {Piece{whole, rank == 0 ? FlatRange{0, 13} : FlatRange{13, 30}}};
  }
  return {Piece{whole, std::nullopt, rank > 0}};
}

// What rank `rank` of `ranks` (1 or 3) asks for when it loads: everything on one rank; on three,
// boxes across the saved ones (columns of the row-split tensor, rows of the column-split one,
// ...) and a flat range.
inline std::vector<Piece> LoadPieces(const TensorSpec& s, int rank, int ranks) {
  const Box whole = Box::Whole(s.shape);
  if (ranks == 1) return {Piece{whole}};
  const int64_t r = rank;
  if (s.key == "a.f32") return {Piece{Box{{0, r * 10 / 3}, {6, (r + 1) * 10 / 3 - r * 10 / 3}}}};
  if (s.key == "b.bf16") return {Piece{Rows(s.shape, 3 * r, 3 * r + 3)}};
  if (s.key == "c.i64") return {Piece{Box{{4 * r}, {4}}}};
  if (s.key == "d.f16") {
    if (rank == 2) return {Piece{whole, FlatRange{7, 25}}};
    return {Piece{Box{{r, 0, 0}, {1, 5, 2}}}};
  }
  if (s.key == "f.bool") return {Piece{Box{{r * 5 / 3}, {(r + 1) * 5 / 3 - r * 5 / 3}}}};
  return {Piece{whole}};
}

// The bytes of `piece` of tensor `s` in `values`.
inline std::vector<uint8_t> PieceBytes(const Values& values, const TensorSpec& s,
                                       const Piece& piece) {
  const size_t element = DTypeSize(s.dtype);
  std::vector<uint8_t> bytes = Slice(values.tensors.at(s.key), s.shape, piece.box, element);
  if (!piece.flat) return bytes;
  return std::vector<uint8_t>(bytes.begin() + piece.flat->begin * element,
                              bytes.begin() + piece.flat->end * element);
}

// One rank's state dict over memory of its own: the pieces it saves (filled from `values`) or
// asks for (zeroed, to load into), and the objects.
class RankState {
 public:
  using Layout = std::vector<Piece> (*)(const TensorSpec&, int, int);

  RankState(const Values& values, Layout layout, int rank, int ranks, bool fill) {
    for (const TensorSpec& s : Specs()) {
      for (const Piece& piece : layout(s, rank, ranks)) {
        std::vector<uint8_t> want = PieceBytes(values, s, piece);
        buffers_.push_back(fill ? want : std::vector<uint8_t>(want.size(), 0));
        void* data = buffers_.back().data();
        ShardedTensor t;
        if (piece.flat) {
          t = ShardedTensor::FlatShard(
              s.key, TensorView(data, s.dtype, {piece.flat->end - piece.flat->begin}), s.shape,
              piece.box.offsets, piece.box.sizes, piece.flat->begin);
        } else {
          t = ShardedTensor::Shard(s.key, TensorView(data, s.dtype, piece.box.sizes), s.shape,
                                   piece.box.offsets);
        }
        if (piece.replica) t.replica_id = {rank};
        Keep(dict_.Add(std::move(t)));
        pieces_.push_back({s.key + " " + piece.box.ToString() +
                               (piece.flat ? " flat [" + std::to_string(piece.flat->begin) + ", " +
                                                 std::to_string(piece.flat->end) + ")"
                                           : ""),
                           buffers_.size() - 1, std::move(want)});
      }
    }
    for (const auto& [key, bytes] : values.objects) {
      ShardedObject object{
          key, fill ? bytes : std::vector<uint8_t>(), {}, ObjectEncoding::kTorchSave};
      if (rank > 0) object.replica_id = {rank};
      Keep(dict_.Add(std::move(object)));
    }
  }

  // Whether the state was built (StateDict::Add accepted every entry).
  const Status& status() const { return status_; }
  StateDict& dict() { return dict_; }

  // Every piece (and, with `objects`, every object) holds `values`' bytes; errors name the
  // first that does not.
  Status Check(const Values& values, bool objects = true) const {
    for (const Loaded& p : pieces_) {
      if (buffers_[p.buffer] != p.want) return Internal("key " + p.what + " loaded other bytes");
    }
    for (const StateEntry& entry : dict_.entries()) {
      if (!objects) break;
      const auto* object = std::get_if<ShardedObject>(&entry);
      if (object == nullptr) continue;
      if (object->data != values.objects.at(object->key) ||
          object->encoding != ObjectEncoding::kTorchSave) {
        return Internal("object '" + object->key + "' loaded other bytes or another encoding");
      }
    }
    return Status::Ok();
  }

 private:
  void Keep(const Status& status) {
    if (status_.ok()) status_ = status;
  }
  struct Loaded {
    std::string what;
    size_t buffer;
    std::vector<uint8_t> want;
  };
  std::deque<std::vector<uint8_t>> buffers_;  // stable: the dict points into them
  std::vector<Loaded> pieces_;
  StateDict dict_;
  Status status_;
};

// ---- Writing and reading a checkpoint in the format. -----------------------------------------

// Runs fn(comm) on `ranks` ranks (LocalComm); the first error.
inline Status OnRanks(int ranks, const std::function<Status(Comm&)>& fn) {
  return FirstError(
      RunLocalRanks(ranks, fn, LocalCommOptions{.timeout = std::chrono::seconds(60)}));
}

// Saves `values` at `path` in tessera's format (or `format`) from `ranks` ranks (1 or 2).
inline Status SaveAs(CheckpointFormat format, const Values& values, const std::string& path,
                     int ranks, std::shared_ptr<Storage> storage) {
  return OnRanks(ranks, [&](Comm& comm) -> Status {
    RankState state(values, SavePieces, comm.rank(), ranks, /*fill=*/true);
    TESSERA_RETURN_IF_ERROR(state.status());
    SaveOptions options;
    options.format = format;
    options.storage = storage;
    options.user_metadata = values.user_metadata;
    return Save(state.dict(), path, comm, options).status();
  });
}

// Converts `src` into `dst` in `format` on `ranks` ranks, small output files (so that a format
// with an index for several files writes one).
inline Status ConvertAs(CheckpointFormat format, const std::string& src, const std::string& dst,
                        int ranks, std::shared_ptr<Storage> storage) {
  return OnRanks(ranks, [&](Comm& comm) -> Status {
    ConvertOptions options;
    options.to = format;
    options.storage = storage;
    options.max_file_bytes = 128;
    return Convert(src, dst, options, comm).status();
  });
}

// Writes `values` at `path` in the format from `ranks` ranks (1 or 2): saved, or saved in
// tessera's format at `path`.tessera and converted.
inline Status Write(const FormatUnderTest& f, const FormatCapabilities& caps, const Values& values,
                    const std::string& path, int ranks, std::shared_ptr<Storage> storage) {
  const CheckpointFormat id = f.format->id();
  if (caps.saves) return SaveAs(id, values, path, ranks, storage);
  TESSERA_RETURN_IF_ERROR(
      SaveAs(CheckpointFormat::kTessera, values, path + ".tessera", ranks, storage));
  return ConvertAs(id, path + ".tessera", path, ranks, storage);
}

// Loads `path` on `ranks` ranks (1 or 3), each asking for LoadPieces, and checks every byte
// against `values`.
inline Status LoadAndCheck(const Values& values, const std::string& path, int ranks,
                           std::shared_ptr<Storage> storage) {
  return OnRanks(ranks, [&](Comm& comm) -> Status {
    RankState state(values, LoadPieces, comm.rank(), ranks, /*fill=*/false);
    TESSERA_RETURN_IF_ERROR(state.status());
    LoadOptions options;
    options.storage = storage;
    TESSERA_RETURN_IF_ERROR(Load(state.dict(), path, comm, options).status());
    return state.Check(values);
  });
}

// The path of the index of the checkpoint at `path` (its commit, for numbered commits).
inline Result<std::string> IndexPath(const FormatUnderTest& f, const std::string& path,
                                     std::shared_ptr<Storage> storage) {
  TESSERA_ASSIGN_OR_RETURN(const Metadata m, ReadMetadata(path, storage));
  ConvertOptions options;
  options.to = f.format->id();
  TESSERA_ASSIGN_OR_RETURN(const std::unique_ptr<FormatWriter> writer,
                           f.format->NewConversionWriter(options));
  if (!writer->NeedsIndex(m.files.size())) {
    return Internal(path + " has no index file (" + std::to_string(m.files.size()) + " files)");
  }
  return JoinPath(path, writer->NumberedCommits() ? writer->IndexFileName(m.commit_seq)
                                                  : writer->IndexFileName());
}

// Fails unless `status` is an error naming `path`; `what` says what caused it.
inline Status ExpectErrorNaming(const Status& status, const std::string& path,
                                const std::string& what) {
  if (status.ok()) return Internal(what + ": no error");
  if (status.message().find(path) == std::string::npos) {
    return Internal(what + ": the error does not name " + path + ": " + status.ToString());
  }
  return Status::Ok();
}

// ---- The cases. ---------------------------------------------------------------------------------

inline constexpr char kDir[] = "/ckpt/out";

inline Status RoundTrip(const FormatUnderTest& f) {
  const FormatCapabilities caps = CapabilitiesOf(f);
  auto storage = std::make_shared<MemoryStorage>();
  const Values values = MakeValues(f, 1, caps);
  TESSERA_RETURN_IF_ERROR(Write(f, caps, values, kDir, 1, storage));
  TESSERA_ASSIGN_OR_RETURN(const Metadata m, ReadMetadata(kDir, storage));
  TESSERA_RETURN_IF_ERROR(Expect(m.format == f.format->id(), "ReadMetadata says the format"));
  TESSERA_RETURN_IF_ERROR(Expect(std::string(FormatName(m.format)) == f.format->name(),
                                 "the format's name for messages is its own"));
  TESSERA_RETURN_IF_ERROR(Expect(m.tensors.size() == Specs().size(), "every tensor is there"));
  TESSERA_RETURN_IF_ERROR(Expect(m.objects.size() == values.objects.size(), "every object"));
  for (const auto& [key, value] : values.user_metadata) {
    const auto it = m.user_metadata.find(key);
    TESSERA_RETURN_IF_ERROR(Expect(it != m.user_metadata.end() && it->second == value,
                                   "user metadata '" + key + "' is kept"));
  }
  return LoadAndCheck(values, kDir, 1, storage);
}

inline Status Reshard2To3(const FormatUnderTest& f) {
  const FormatCapabilities caps = CapabilitiesOf(f);
  auto storage = std::make_shared<MemoryStorage>();
  const Values values = MakeValues(f, 2, caps);
  TESSERA_RETURN_IF_ERROR(Write(f, caps, values, kDir, 2, storage));
  TESSERA_RETURN_IF_ERROR(LoadAndCheck(values, kDir, 3, storage));
  return LoadAndCheck(values, kDir, 1, storage);
}

inline Status ConvertBothWays(const FormatUnderTest& f) {
  const FormatCapabilities caps = CapabilitiesOf(f);
  auto storage = std::make_shared<MemoryStorage>();
  // From the format into tessera's.
  const Values a = MakeValues(f, 3, caps);
  TESSERA_RETURN_IF_ERROR(Write(f, caps, a, "/ckpt/a", 1, storage));
  TESSERA_RETURN_IF_ERROR(
      ConvertAs(CheckpointFormat::kTessera, "/ckpt/a", "/ckpt/a.out", 1, storage));
  TESSERA_ASSIGN_OR_RETURN(const Metadata am, ReadMetadata("/ckpt/a.out", storage));
  TESSERA_RETURN_IF_ERROR(
      Expect(am.format == CheckpointFormat::kTessera, "converted into tessera"));
  TESSERA_RETURN_IF_ERROR(LoadAndCheck(a, "/ckpt/a.out", 1, storage));
  // From tessera's into the format, on two ranks.
  const Values b = MakeValues(f, 4, caps);
  TESSERA_RETURN_IF_ERROR(SaveAs(CheckpointFormat::kTessera, b, "/ckpt/b", 2, storage));
  TESSERA_RETURN_IF_ERROR(ConvertAs(f.format->id(), "/ckpt/b", "/ckpt/b.out", 2, storage));
  TESSERA_ASSIGN_OR_RETURN(const Metadata bm, ReadMetadata("/ckpt/b.out", storage));
  TESSERA_RETURN_IF_ERROR(Expect(bm.format == f.format->id(), "converted into the format"));
  return LoadAndCheck(b, "/ckpt/b.out", 3, storage);
}

inline Status VerifyNamesAFlippedDataByte(const FormatUnderTest& f) {
  const FormatCapabilities caps = CapabilitiesOf(f);
  auto storage = std::make_shared<MemoryStorage>();
  const Values values = MakeValues(f, 5, caps);
  TESSERA_RETURN_IF_ERROR(Write(f, caps, values, kDir, 1, storage));
  TESSERA_ASSIGN_OR_RETURN(const VerifyReport report, Verify(kDir, storage));
  TESSERA_RETURN_IF_ERROR(Expect(report.checksums, "Verify checked the bytes' checksums"));
  TESSERA_RETURN_IF_ERROR(Expect(report.format == f.format->id(), "Verify says the format"));
  // One byte in the middle of the largest tensor's chunk.
  TESSERA_ASSIGN_OR_RETURN(const Metadata m, ReadMetadata(kDir, storage));
  const TensorInfo* tensor = m.FindTensor("a.f32");
  TESSERA_RETURN_IF_ERROR(Expect(tensor != nullptr && !tensor->chunks.empty(), "a.f32 is there"));
  const ByteLocation& at = tensor->chunks[0].location;
  const std::string file = JoinPath(kDir, m.files[at.file_index].name);
  TESSERA_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, storage->GetFileContents(file));
  bytes.at(at.offset + at.length / 2) ^= 0x10;
  storage->SetFileContents(file, std::move(bytes));
  TESSERA_RETURN_IF_ERROR(
      ExpectErrorNaming(Verify(kDir, storage).status(), file, "Verify of a flipped data byte"));
  TESSERA_RETURN_IF_ERROR(ExpectErrorNaming(LoadAndCheck(values, kDir, 1, storage), file,
                                            "a load of a flipped data byte"));
  return Status::Ok();
}

// What the directory `path` holds after a crash: the checkpoint `old` (null: none), or `now`.
// Returns which (0 old, 1 new); an error for anything else.
inline Result<int> OldOrNew(const Values* old, const Values& now, const std::string& path,
                            std::shared_ptr<Storage> storage) {
  Result<Metadata> m = ReadMetadata(path, storage);
  if (!m.ok()) {
    const StatusCode code = m.status().code();
    if (old == nullptr &&
        (code == StatusCode::kNotFound || code == StatusCode::kFailedPrecondition)) {
      return 0;  // no checkpoint, as before
    }
    return m.status();
  }
  if (old != nullptr && LoadAndCheck(*old, path, 1, storage).ok()) return 0;
  const Status loaded = LoadAndCheck(now, path, 1, storage);
  if (!loaded.ok()) return Internal("neither the old nor the new checkpoint: " + loaded.ToString());
  return 1;
}

inline Status ACrashAtEveryStorageOperation(const FormatUnderTest& f) {
  const FormatCapabilities caps = CapabilitiesOf(f);
  const Values old_values = MakeValues(f, 6, caps);
  const Values new_values = MakeValues(f, 7, caps);
  int64_t operations = 0;
  int outcomes[2] = {0, 0};
  std::vector<std::string> old_files;  // of the old checkpoint
  for (int64_t fail_at = 0;; ++fail_at) {
    auto memory = std::make_shared<MemoryStorage>();
    auto faulty = std::make_shared<FaultInjectingStorage>(memory);
    if (caps.saves) {
      // A save over the previous one.
      TESSERA_RETURN_IF_ERROR(SaveAs(f.format->id(), old_values, kDir, 1, faulty));
      TESSERA_ASSIGN_OR_RETURN(const Metadata old, ReadMetadata(kDir, memory));
      old_files.clear();
      for (const FileInfo& file : old.files) old_files.push_back(JoinPath(kDir, file.name));
      faulty->SetPlan({.fail_at = fail_at, .crash = true});
      (void)SaveAs(f.format->id(), new_values, kDir, 1, faulty);
    } else {
      // A conversion into a fresh directory (its files are the checkpoint: no save replaces
      // them).
      TESSERA_RETURN_IF_ERROR(
          SaveAs(CheckpointFormat::kTessera, new_values, "/ckpt/src", 1, memory));
      faulty->SetPlan({.fail_at = fail_at, .crash = true});
      (void)ConvertAs(f.format->id(), "/ckpt/src", kDir, 1, faulty);
    }
    const bool fired = faulty->fault_fired();
    operations = faulty->operation_count();
    // A save that ran to the end removed the old checkpoint's files (looked at before the
    // crash: a removal is not durable until its directory is synced).
    for (const std::string& file : fired ? std::vector<std::string>() : old_files) {
      TESSERA_ASSIGN_OR_RETURN(const FileType type, memory->Stat(file));
      TESSERA_RETURN_IF_ERROR(
          Expect(type == FileType::kNotFound, file + " of the replaced checkpoint was removed"));
    }
    memory->SimulateCrash();
    Result<int> outcome = OldOrNew(caps.saves ? &old_values : nullptr, new_values, kDir, memory);
    if (!outcome.ok()) {
      return outcome.status().WithContext("after a crash at storage operation " +
                                          std::to_string(fail_at));
    }
    ++outcomes[*outcome];
    if (!fired) break;  // the write ran to the end
    if (fail_at > 100000) return Internal("the write never ends");
  }
  TESSERA_RETURN_IF_ERROR(Expect(operations > 10, "a write takes more than 10 operations"));
  TESSERA_RETURN_IF_ERROR(Expect(outcomes[0] > 0 && outcomes[1] > 0,
                                 "some crashes left the old checkpoint, others the new one (" +
                                     std::to_string(outcomes[0]) + " old, " +
                                     std::to_string(outcomes[1]) + " new)"));
  return Status::Ok();
}

inline Status ATruncatedIndexIsAnErrorNamingIt(const FormatUnderTest& f) {
  const FormatCapabilities caps = CapabilitiesOf(f);
  auto storage = std::make_shared<MemoryStorage>();
  const Values values = MakeValues(f, 8, caps);
  TESSERA_RETURN_IF_ERROR(Write(f, caps, values, kDir, 1, storage));
  TESSERA_ASSIGN_OR_RETURN(const std::string index, IndexPath(f, kDir, storage));
  TESSERA_ASSIGN_OR_RETURN(const std::vector<uint8_t> whole, storage->GetFileContents(index));
  // Cut before its last byte that is not ASCII white space (a JSON index may end with a line
  // break, which means nothing).
  size_t last = whole.size() - 1;
  while (last > 0 && std::isspace(whole[last])) --last;
  for (size_t size : {size_t{0}, size_t{1}, whole.size() / 2, last}) {
    storage->SetFileContents(index, std::vector<uint8_t>(whole.begin(), whole.begin() + size));
    const std::string what = "the index cut to " + std::to_string(size) + " bytes";
    TESSERA_RETURN_IF_ERROR(ExpectErrorNaming(ReadMetadata(kDir, storage).status(), index, what));
    TESSERA_RETURN_IF_ERROR(
        ExpectErrorNaming(LoadAndCheck(values, kDir, 1, storage), index, what + ", loaded"));
  }
  return Status::Ok();
}

// Flips each byte of the index in turn (xor `mask`) and calls check(status of ReadMetadata,
// what), restoring it after each.
inline Status ForEachFlippedIndexByte(
    const FormatUnderTest& f, const Values& values, std::shared_ptr<MemoryStorage> storage,
    const std::function<Status(const std::string& index, const std::string& what)>& check) {
  const FormatCapabilities caps = CapabilitiesOf(f);
  TESSERA_RETURN_IF_ERROR(Write(f, caps, values, kDir, 1, storage));
  TESSERA_ASSIGN_OR_RETURN(const std::string index, IndexPath(f, kDir, storage));
  TESSERA_ASSIGN_OR_RETURN(const std::vector<uint8_t> whole, storage->GetFileContents(index));
  for (size_t i = 0; i < whole.size(); ++i) {
    for (uint8_t mask : {uint8_t{0x01}, uint8_t{0x80}}) {
      std::vector<uint8_t> flipped = whole;
      flipped[i] ^= mask;
      storage->SetFileContents(index, std::move(flipped));
      TESSERA_RETURN_IF_ERROR(check(index, "byte " + std::to_string(i) + " of " +
                                               std::to_string(whole.size()) + " of the index xor " +
                                               std::to_string(mask)));
    }
  }
  storage->SetFileContents(index, whole);
  return LoadAndCheck(values, kDir, 1, storage);
}

inline Status AFlippedIndexByteIsAnErrorNamingIt(const FormatUnderTest& f) {
  auto storage = std::make_shared<MemoryStorage>();
  const Values values = MakeValues(f, 9, CapabilitiesOf(f));
  return ForEachFlippedIndexByte(
      f, values, storage, [&](const std::string& index, const std::string& what) {
        return ExpectErrorNaming(ReadMetadata(kDir, storage).status(), index, what);
      });
}

// Each byte of the index flipped in turn: a read or a load fails, or the load gives back the
// saved tensors (and, with `objects`, objects).
inline Status FlippedIndexBytesNeverLoadWrongValues(const FormatUnderTest& f, bool objects) {
  auto storage = std::make_shared<MemoryStorage>();
  const Values values = MakeValues(f, 10, CapabilitiesOf(f));
  return ForEachFlippedIndexByte(
      f, values, storage, [&](const std::string&, const std::string& what) -> Status {
        if (!ReadMetadata(kDir, storage).ok()) return Status::Ok();
        RankState state(values, LoadPieces, 0, 1, /*fill=*/false);
        LoadOptions options;
        options.storage = storage;
        if (!Load(state.dict(), kDir, options).ok()) return Status::Ok();
        return state.Check(values, objects).WithContext(what + ": the load succeeded");
      });
}

inline Status AFlippedIndexByteNeverLoadsWrongTensors(const FormatUnderTest& f) {
  return FlippedIndexBytesNeverLoadWrongValues(f, /*objects=*/false);
}

inline Status AFlippedIndexByteNeverLoadsWrongObjects(const FormatUnderTest& f) {
  return FlippedIndexBytesNeverLoadWrongValues(f, /*objects=*/true);
}

}  // namespace format_cases

// One case of the suite: its name, whether it applies to a format that can do what it needs,
// and its body (errors say what failed).
struct FormatSuiteCase {
  const char* name;
  bool (*applies)(const FormatCapabilities&);
  Status (*run)(const FormatUnderTest&);
};

// Every case, in a fixed order.
inline const std::vector<FormatSuiteCase>& FormatSuiteCases() {
  using C = const FormatCapabilities&;
  static const std::vector<FormatSuiteCase> cases = {
      {"RoundTrip", [](C) { return true; }, format_cases::RoundTrip},
      {"Reshard2To3", [](C) { return true; }, format_cases::Reshard2To3},
      {"ConvertBothWays", [](C) { return true; }, format_cases::ConvertBothWays},
      {"VerifyNamesAFlippedDataByte", [](C c) { return c.data_checksums; },
       format_cases::VerifyNamesAFlippedDataByte},
      {"ACrashAtEveryStorageOperation", [](C) { return true; },
       format_cases::ACrashAtEveryStorageOperation},
      {"ATruncatedIndexIsAnErrorNamingIt", [](C) { return true; },
       format_cases::ATruncatedIndexIsAnErrorNamingIt},
      {"AFlippedIndexByteIsAnErrorNamingIt", [](C c) { return c.index_checksum; },
       format_cases::AFlippedIndexByteIsAnErrorNamingIt},
      {"AFlippedIndexByteNeverLoadsWrongTensors", [](C) { return true; },
       format_cases::AFlippedIndexByteNeverLoadsWrongTensors},
      {"AFlippedIndexByteNeverLoadsWrongObjects",
       [](C c) { return c.objects && c.object_checksums; },
       format_cases::AFlippedIndexByteNeverLoadsWrongObjects},
  };
  return cases;
}

// The names of the cases a format that can do `caps` runs, in order.
inline std::vector<std::string> FormatSuiteCaseNames(const FormatCapabilities& caps) {
  std::vector<std::string> names;
  for (const FormatSuiteCase& c : FormatSuiteCases()) {
    if (c.applies(caps)) names.push_back(c.name);
  }
  return names;
}

// Runs `test_case` on `format`, registering it for the case's duration when it must be.
inline Status RunFormatSuiteCase(const FormatSuiteCase& test_case, const FormatUnderTest& format) {
  std::optional<ScopedFormatRegistration> registration;
  if (format.options.register_for_test) registration.emplace(*format.format);
  return test_case.run(format);
}

// The test of one case on one format.
class FormatSuiteTest : public ::testing::Test {
 public:
  FormatSuiteTest(FormatUnderTest format, const FormatSuiteCase* test_case)
      : format_(std::move(format)), case_(test_case) {}
  void TestBody() override {
    const Status status = RunFormatSuiteCase(*case_, format_);
    EXPECT_TRUE(status.ok()) << case_->name << " on format " << format_.format->name() << ": "
                             << status.ToString();
  }

 private:
  FormatUnderTest format_;
  const FormatSuiteCase* case_;
};

// Registers every case that applies to `format` (CapabilitiesOf) as <name>/FormatTest.<case>.
// Call before RUN_ALL_TESTS (TESSERA_INSTANTIATE_FORMAT_SUITE does, at static initialization).
// Returns the number of cases registered.
inline int RegisterFormatSuite(const std::string& name, const Format& format,
                               FormatSuiteOptions options, const char* file, int line) {
  const FormatUnderTest under_test{&format, std::move(options)};
  const FormatCapabilities caps = CapabilitiesOf(under_test);
  const std::string suite = name + "/FormatTest";
  int registered = 0;
  for (const FormatSuiteCase& c : FormatSuiteCases()) {
    if (!c.applies(caps)) continue;
    ::testing::RegisterTest(suite.c_str(), c.name, nullptr, nullptr, file, line,
                            [under_test, test_case = &c]() -> ::testing::Test* {
                              return new FormatSuiteTest(under_test, test_case);
                            });
    ++registered;
  }
  return registered;
}

}  // namespace tessera::testing

// Runs the suite on a format: `name` (an identifier) names the instantiation, `format` (an
// expression of type const tessera::Format&, in parentheses if it holds a comma) is the format,
// and the optional arguments after it initialize a tessera::testing::FormatSuiteOptions
// (designated initializers in the order of its fields, e.g. .index_checksum = true). At
// namespace scope, once per name.
#define TESSERA_INSTANTIATE_FORMAT_SUITE(name, format, ...)                                        \
  [[maybe_unused]] static const int tessera_format_suite_##name =                                  \
      ::tessera::testing::RegisterFormatSuite(#name, (format),                                     \
                                              ::tessera::testing::FormatSuiteOptions{__VA_ARGS__}, \
                                              __FILE__, __LINE__)

#endif  // TESSERA_TESTING_FORMAT_SUITE_H_
