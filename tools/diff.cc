// tessera diff A B: what differs between two checkpoints (any formats tessera reads): keys on
// one side only (a list torch DCP keeps as one object and tessera keys per element is one key
// spelled two ways, not two differences), dtype or shape changes, and with --values which tensors
// and objects differ and by how much. Exit 0 when identical (values compared), 1 when they differ,
// 2 on error, 3 when keys, shapes and dtypes are the same and the values were not compared (no
// --values).
//
// --values reads both checkpoints piece by piece (at most kBatchBytes per side in memory),
// and skips every chunk whose checksums match on both sides when both were saved with the same
// chunking and checksums (the usual case for two saves of one job).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "tessera/checkpoint.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/text.h"

namespace tessera::tools {
namespace {

// Bytes of tensor data read per side per round of --values.
constexpr uint64_t kBatchBytes = 32u << 20;
constexpr char kStructureKey[] = "tessera.python.structure";
// Metadata values longer than this (bytes) are not printed in the text output.
constexpr size_t kLongMetadata = 200;

// ---- element values ---------------------------------------------------------------------------

double HalfToDouble(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(mant, -24);
  } else if (exp == 31) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(mant + 1024, exp - 25);
  }
  return sign ? -v : v;
}

double Float8E4M3ToDouble(uint8_t b) {  // float8_e4m3fn: no infinities, S.1111.111 is NaN
  const int sign = b >> 7, exp = (b >> 3) & 0xf, mant = b & 0x7;
  double v;
  if (exp == 15 && mant == 7) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(mant, -9);
  } else {
    v = std::ldexp(mant + 8, exp - 10);
  }
  return sign ? -v : v;
}

// Element `i` of `data` (of `dtype`) as a double.
double ValueAt(const uint8_t* data, DType dtype, size_t i) {
  auto load = [&](auto zero) {
    decltype(zero) v;
    std::memcpy(&v, data + i * sizeof(v), sizeof(v));
    return v;
  };
  switch (dtype) {
    case DType::kF64:
      return load(double{});
    case DType::kF32:
      return load(float{});
    case DType::kF16:
      return HalfToDouble(load(uint16_t{}));
    case DType::kBF16: {
      const uint32_t bits = static_cast<uint32_t>(load(uint16_t{})) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case DType::kF8E4M3:
      return Float8E4M3ToDouble(data[i]);
    case DType::kF8E5M2:
      return HalfToDouble(static_cast<uint16_t>(data[i] << 8));
    case DType::kI64:
      return static_cast<double>(load(int64_t{}));
    case DType::kI32:
      return load(int32_t{});
    case DType::kI16:
      return load(int16_t{});
    case DType::kI8:
      return static_cast<int8_t>(data[i]);
    case DType::kU8:
    case DType::kBool:
      return data[i];
    case DType::kU16:
      return load(uint16_t{});
    case DType::kU32:
      return load(uint32_t{});
    case DType::kU64:
      return static_cast<double>(load(uint64_t{}));
  }
  return 0;
}

// How the values of one tensor (or object) differ.
struct ValueDiff {
  uint64_t elements_differing = 0;  // bitwise
  double max_abs_diff = 0;          // over the differing elements whose difference is a number
  bool nan_mismatch = false;        // a NaN on one side only (or NaNs of different bits)
  bool object = false;              // an object: its bytes differ
};

void CompareElements(const uint8_t* a, const uint8_t* b, DType dtype, size_t n, ValueDiff& d) {
  const size_t size = DTypeSize(dtype);
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i * size, b + i * size, size) == 0) continue;
    ++d.elements_differing;
    const double x = ValueAt(a, dtype, i), y = ValueAt(b, dtype, i);
    const double diff = std::fabs(x - y);
    if (std::isnan(diff)) {
      // inf - inf is no NaN of the data; NaN on either side is.
      if (std::isnan(x) || std::isnan(y))
        d.nan_mismatch = true;
      else
        d.max_abs_diff = std::numeric_limits<double>::infinity();
    } else {
      d.max_abs_diff = std::max(d.max_abs_diff, diff);
    }
  }
}

// ---- planning the reads -------------------------------------------------------------------------

// Boxes of `box` of at most `budget` bytes (elements of `element` bytes), row-major slabs.
void SplitBox(const Box& box, size_t element, uint64_t budget, std::vector<Box>& out) {
  const uint64_t bytes = static_cast<uint64_t>(box.NumElements()) * element;
  size_t d = 0;
  while (d < box.rank() && box.sizes[d] <= 1) ++d;
  if (bytes <= budget || d == box.rank()) {
    out.push_back(box);
    return;
  }
  const uint64_t slab = bytes / static_cast<uint64_t>(box.sizes[d]);  // bytes per index of d
  const int64_t per = slab <= budget ? static_cast<int64_t>(budget / slab) : 1;
  for (int64_t at = 0; at < box.sizes[d]; at += per) {
    Box part = box;
    part.offsets[d] += at;
    part.sizes[d] = std::min(per, box.sizes[d] - at);
    if (slab <= budget) {
      out.push_back(part);
    } else {
      SplitBox(part, element, budget, out);
    }
  }
}

// Two chunks hold the same bytes when their checksums say so: same box, same length, same
// checksums of the same blocks, stored the same way.
bool SameByChecksum(const Metadata& ma, const ChunkInfo& a, const Metadata& mb,
                    const ChunkInfo& b) {
  return ma.checksum != ChecksumKind::kNone && ma.checksum == mb.checksum && a.box == b.box &&
         a.location.length == b.location.length && a.location.checksum == b.location.checksum &&
         a.block_checksums == b.block_checksums &&
         (a.block_checksums.empty() || ma.checksum_block_bytes == mb.checksum_block_bytes) &&
         a.encoding == ChunkEncoding::kRaw && b.encoding == ChunkEncoding::kRaw &&
         a.storage_order == b.storage_order;
}

// The boxes of tensor `a` (same dtype and shape in both) whose values must be read: the
// chunks of A, less those B holds with matching checksums. `skipped` counts the others.
std::vector<Box> BoxesToRead(const Metadata& ma, const TensorInfo& a, const Metadata& mb,
                             const TensorInfo& b, uint64_t& skipped) {
  std::map<Dims, const ChunkInfo*> b_by_offset;
  for (const ChunkInfo& c : b.chunks) b_by_offset[c.box.offsets] = &c;
  std::vector<Box> boxes;
  for (const ChunkInfo& c : a.chunks) {
    auto it = b_by_offset.find(c.box.offsets);
    if (it != b_by_offset.end() && SameByChecksum(ma, c, mb, *it->second)) {
      ++skipped;
      continue;
    }
    SplitBox(c.box, DTypeSize(a.dtype), kBatchBytes, boxes);
  }
  return boxes;
}

struct Piece {
  const TensorInfo* tensor;
  Box box;
  uint64_t bytes;
};

// Reads `pieces` (distinct keys) from both checkpoints and compares them.
Status CompareBatch(const std::string& path_a, const std::string& path_b,
                    const std::vector<Piece>& pieces, std::map<std::string, ValueDiff>& diffs) {
  std::vector<std::vector<uint8_t>> buffers[2];
  StateDict states[2];
  for (int side = 0; side < 2; ++side) {
    for (const Piece& p : pieces) {
      buffers[side].emplace_back(p.bytes);
      TESSERA_RETURN_IF_ERROR(states[side].Add(ShardedTensor::Shard(
          p.tensor->key, TensorView(buffers[side].back().data(), p.tensor->dtype, p.box.sizes),
          p.tensor->global_shape, p.box.offsets)));
    }
    LoadOptions options;
    options.unexpected_keys = KeyPolicy::kSkip;
    TESSERA_RETURN_IF_ERROR(Load(states[side], side == 0 ? path_a : path_b, options).status());
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    ValueDiff& d = diffs[pieces[i].tensor->key];
    CompareElements(buffers[0][i].data(), buffers[1][i].data(), pieces[i].tensor->dtype,
                    static_cast<size_t>(pieces[i].box.NumElements()), d);
  }
  return Status::Ok();
}

// Compares the values of the tensors in `both`, batch by batch: each batch holds at most one
// piece per key and kBatchBytes (one piece alone may reach it).
Status CompareTensors(const std::string& path_a, const Metadata& ma, const std::string& path_b,
                      const Metadata& mb, const std::vector<std::string>& both,
                      std::map<std::string, ValueDiff>& diffs, uint64_t& skipped) {
  std::vector<Piece> todo;
  for (const std::string& key : both) {
    const TensorInfo& a = *ma.FindTensor(key);
    for (Box& box : BoxesToRead(ma, a, mb, *mb.FindTensor(key), skipped)) {
      const uint64_t bytes = static_cast<uint64_t>(box.NumElements()) * DTypeSize(a.dtype);
      todo.push_back({&a, std::move(box), bytes});
    }
  }
  while (!todo.empty()) {
    std::vector<Piece> batch, rest;
    std::set<std::string> keys;
    uint64_t bytes = 0;
    for (Piece& p : todo) {
      const bool fits = batch.empty() || bytes + p.bytes <= kBatchBytes;
      if (fits && keys.insert(p.tensor->key).second) {
        bytes += p.bytes;
        batch.push_back(std::move(p));
      } else {
        rest.push_back(std::move(p));
      }
    }
    TESSERA_RETURN_IF_ERROR(CompareBatch(path_a, path_b, batch, diffs));
    todo = std::move(rest);
  }
  return Status::Ok();
}

const char* EncodingName(ObjectEncoding encoding) {
  switch (encoding) {
    case ObjectEncoding::kBytes:
      return "bytes";
    case ObjectEncoding::kPickle:
      return "a pickle";
    case ObjectEncoding::kTorchSave:
      return "a torch.save archive";
    case ObjectEncoding::kJson:
      return "JSON";
  }
  return "unknown";
}

// Objects of both sides: equal checksums decide; otherwise their bytes are read and compared.
// Objects encoded differently (a torch.save archive in a DCP checkpoint, a pickle in tessera's)
// are not compared: equal values have other bytes. Their keys and why go to `not_compared`.
Status CompareObjects(const std::string& path_a, const Metadata& ma, const std::string& path_b,
                      const Metadata& mb, const std::vector<std::string>& both,
                      std::map<std::string, ValueDiff>& diffs, uint64_t& skipped,
                      std::vector<std::pair<std::string, std::string>>& not_compared) {
  StateDict states[2];
  for (const std::string& key : both) {
    const ObjectInfo& a = *ma.FindObject(key);
    const ObjectInfo& b = *mb.FindObject(key);
    if (a.encoding != b.encoding) {
      not_compared.emplace_back(key, std::string(EncodingName(a.encoding)) + " in a, " +
                                         EncodingName(b.encoding) + " in b");
      continue;
    }
    if (a.location.length != b.location.length) {
      diffs[key].object = true;
      continue;
    }
    if (ma.checksum != ChecksumKind::kNone && ma.checksum == mb.checksum &&
        a.location.checksum == b.location.checksum) {
      ++skipped;
      continue;
    }
    for (StateDict& s : states) TESSERA_RETURN_IF_ERROR(s.Add(ShardedObject{key, {}, {}}));
  }
  if (states[0].entries().empty()) return Status::Ok();
  for (int side = 0; side < 2; ++side) {
    LoadOptions options;
    options.unexpected_keys = KeyPolicy::kSkip;
    TESSERA_RETURN_IF_ERROR(Load(states[side], side == 0 ? path_a : path_b, options).status());
  }
  for (size_t i = 0; i < states[0].entries().size(); ++i) {
    const auto& a = std::get<ShardedObject>(states[0].entries()[i]);
    const auto& b = std::get<ShardedObject>(states[1].entries()[i]);
    if (a.data != b.data) diffs[a.key].object = true;
  }
  return Status::Ok();
}

// ---- the comparison -----------------------------------------------------------------------------

struct Side {
  std::string kind;  // "tensor" or "object"
  std::string dtype;
  Shape shape;
};

struct Change {
  std::string key;
  Side a, b;
};

// One entry spelled two ways: an object `key` on one side, its elements as the keys
// "key.0", "key.1", ... (objects, perhaps nested: "key.0.1") on the other. torch DCP keeps a
// list holding no tensor, or a tuple, as one object ("param_groups.0.params"); tessera's own
// format keys each element ("param_groups.0.params.0").
struct Spelling {
  std::string key;
  bool whole_in_a = true;  // the object is in a (the elements in b), else the other way round
  std::vector<std::string> elements;
};

struct DiffResult {
  std::vector<std::string> only_a, only_b;
  std::vector<Spelling> spelled_differently;
  // With --values: objects on both sides whose values were not compared, and why (encoded
  // differently).
  std::vector<std::pair<std::string, std::string>> objects_not_compared;
  std::vector<Change> changed;
  std::vector<std::tuple<std::string, std::string, std::string>> metadata;  // key, a, b
  bool values = false;
  std::map<std::string, ValueDiff> value_diffs;  // only those that differ
  uint64_t tensors_compared = 0, objects_compared = 0;
  uint64_t chunks_skipped = 0;  // equal by checksum, not read
  bool Identical() const {
    return only_a.empty() && only_b.empty() && changed.empty() && value_diffs.empty();
  }
  // Values compared, every one of them: none spelled differently on the two sides.
  bool AllValuesCompared() const {
    return values && spelled_differently.empty() && objects_not_compared.empty();
  }
};

std::optional<Side> SideOf(const Metadata& m, const std::string& key) {
  if (const TensorInfo* t = m.FindTensor(key)) {
    return Side{"tensor", std::string(DTypeName(t->dtype)), t->global_shape};
  }
  if (m.FindObject(key)) return Side{"object", "", {}};
  return std::nullopt;
}

// Moves the keys of `whole` (objects of `m_whole` there) whose elements are all that
// `elements` (keys of `m_elements`) holds under "key." to r.spelled_differently.
void MatchSpellings(std::vector<std::string>& whole, const Metadata& m_whole,
                    std::vector<std::string>& elements, const Metadata& m_elements, bool whole_in_a,
                    DiffResult& r) {
  const std::set<std::string> pending(elements.begin(), elements.end());
  std::set<std::string> taken;
  std::vector<std::string> kept;
  for (const std::string& key : whole) {
    Spelling spelling{.key = key, .whole_in_a = whole_in_a};
    const std::string prefix = key + ".";
    for (auto it = pending.lower_bound(prefix); it != pending.end() && it->starts_with(prefix);
         ++it) {
      spelling.elements.push_back(*it);
    }
    const bool all_objects =
        std::all_of(spelling.elements.begin(), spelling.elements.end(),
                    [&](const std::string& e) { return m_elements.FindObject(e) != nullptr; });
    if (m_whole.FindObject(key) == nullptr || spelling.elements.empty() || !all_objects) {
      kept.push_back(key);
      continue;
    }
    std::sort(spelling.elements.begin(), spelling.elements.end(), NaturalLess);
    taken.insert(spelling.elements.begin(), spelling.elements.end());
    r.spelled_differently.push_back(std::move(spelling));
  }
  whole = std::move(kept);
  std::erase_if(elements, [&](const std::string& e) { return taken.count(e) != 0; });
}

Result<DiffResult> Compare(const std::string& path_a, const Metadata& ma, const std::string& path_b,
                           const Metadata& mb, bool values) {
  DiffResult r;
  r.values = values;
  std::set<std::string> keys;
  for (const Metadata* m : {&ma, &mb}) {
    for (const TensorInfo& t : m->tensors) keys.insert(t.key);
    for (const ObjectInfo& o : m->objects) keys.insert(o.key);
  }
  std::vector<std::string> sorted(keys.begin(), keys.end());
  std::sort(sorted.begin(), sorted.end(), NaturalLess);
  std::vector<std::string> tensors, objects;  // on both sides, alike
  for (const std::string& key : sorted) {
    const std::optional<Side> a = SideOf(ma, key), b = SideOf(mb, key);
    if (!b) {
      r.only_a.push_back(key);
    } else if (!a) {
      r.only_b.push_back(key);
    } else if (a->kind != b->kind || a->dtype != b->dtype || a->shape != b->shape) {
      r.changed.push_back({key, *a, *b});
    } else {
      (a->kind == "tensor" ? tensors : objects).push_back(key);
    }
  }
  MatchSpellings(r.only_a, ma, r.only_b, mb, /*whole_in_a=*/true, r);
  MatchSpellings(r.only_b, mb, r.only_a, ma, /*whole_in_a=*/false, r);
  std::set<std::string> meta_keys;
  for (const auto& [k, v] : ma.user_metadata) meta_keys.insert(k);
  for (const auto& [k, v] : mb.user_metadata) meta_keys.insert(k);
  for (const std::string& k : meta_keys) {
    auto a = ma.user_metadata.find(k), b = mb.user_metadata.find(k);
    const std::string va = a == ma.user_metadata.end() ? "" : a->second;
    const std::string vb = b == mb.user_metadata.end() ? "" : b->second;
    if (va != vb) r.metadata.emplace_back(k, va, vb);
  }
  if (!values) return r;
  r.tensors_compared = tensors.size();
  r.objects_compared = objects.size();
  TESSERA_RETURN_IF_ERROR(
      CompareTensors(path_a, ma, path_b, mb, tensors, r.value_diffs, r.chunks_skipped));
  TESSERA_RETURN_IF_ERROR(CompareObjects(path_a, ma, path_b, mb, objects, r.value_diffs,
                                         r.chunks_skipped, r.objects_not_compared));
  for (auto it = r.value_diffs.begin(); it != r.value_diffs.end();) {
    const ValueDiff& d = it->second;
    it = d.object || d.elements_differing > 0 ? std::next(it) : r.value_diffs.erase(it);
  }
  return r;
}

// ---- output -------------------------------------------------------------------------------------

std::string SideText(const Side& s) {
  return s.kind == "object" ? "object" : s.dtype + " " + ShapeToString(s.shape);
}

std::string DiffText(const ValueDiff& d) {
  if (d.object) return "bytes differ";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", d.max_abs_diff);
  return "max |a-b| " + std::string(buf) + (d.nan_mismatch ? " (and NaNs differ)" : "") + ", " +
         std::to_string(d.elements_differing) + " elements differ";
}

void PrintText(const std::string& path_a, const Metadata& ma, const std::string& path_b,
               const Metadata& mb, const DiffResult& r) {
  const size_t width = static_cast<size_t>(std::max(OutputWidth(), 20));
  // Lines are wrapped, never cut: keys stay whole.
  auto print = [&](const std::string& line) {
    for (const std::string& piece : Wrap(line, width)) std::printf("%s\n", piece.c_str());
  };
  auto describe = [](const std::string& path, const Metadata& m) {
    return Printable(path) + " (" + CheckpointFormatName(m.format) + ", " +
           std::to_string(m.tensors.size() + m.objects.size()) + " keys)";
  };
  print("a: " + describe(path_a, ma));
  print("b: " + describe(path_b, mb));
  auto list = [&](const std::string& title, const std::vector<std::string>& keys) {
    if (keys.empty()) return;
    print(title + " (" + std::to_string(keys.size()) + "):");
    for (const std::string& k : keys) print("  " + Printable(k));
  };
  list("only in a", r.only_a);
  list("only in b", r.only_b);
  if (!r.spelled_differently.empty()) {
    print("spelled differently (" + std::to_string(r.spelled_differently.size()) +
          "; torch DCP keeps a list without tensors, or a tuple, as one object, tessera's format "
          "keys each element; values not compared):");
    for (const Spelling& s : r.spelled_differently) {
      print("  " + Printable(s.key) + ": one object in " + (s.whole_in_a ? "a" : "b") + ", " +
            std::to_string(s.elements.size()) + " elements in " + (s.whole_in_a ? "b" : "a"));
    }
  }
  if (!r.changed.empty()) {
    print("changed (" + std::to_string(r.changed.size()) + "):");
    for (const Change& c : r.changed) {
      print("  " + Printable(c.key) + ": " + SideText(c.a) + " -> " + SideText(c.b));
    }
  }
  for (const auto& [k, va, vb] : r.metadata) {
    if (k == kStructureKey) {
      print("metadata " + k + " differs");
    } else if (va.size() > kLongMetadata || vb.size() > kLongMetadata) {
      // A format's own record (torch_dist.planner_paths) runs to kilobytes: --json has it.
      print("metadata " + Printable(k) + " differs (" + std::to_string(va.size()) + " bytes -> " +
            std::to_string(vb.size()) + " bytes; --json shows both)");
    } else {
      print("metadata " + Printable(k) + ": " + (va.empty() ? "-" : Printable(va)) + " -> " +
            (vb.empty() ? "-" : Printable(vb)));
    }
  }
  if (!r.values) {
    print("values not compared (--values compares them)");
  } else {
    print("values: " + std::to_string(r.value_diffs.size()) + " of " +
          std::to_string(r.tensors_compared + r.objects_compared - r.objects_not_compared.size()) +
          " keys compared differ (" + std::to_string(r.chunks_skipped) +
          " chunks and objects equal by checksum, not read)");
    for (const auto& [key, d] : r.value_diffs) print("  " + Printable(key) + ": " + DiffText(d));
    if (!r.objects_not_compared.empty()) {
      print("objects not compared (" + std::to_string(r.objects_not_compared.size()) +
            "; encoded differently, equal values have other bytes):");
      for (const auto& [key, why] : r.objects_not_compared)
        print("  " + Printable(key) + ": " + why);
    }
  }
  // Without --values nothing says the values agree: "identical" would claim what was not
  // checked (a fine-tuned copy has the same keys, shapes and dtypes).
  const std::string spelled =
      r.spelled_differently.empty()
          ? ""
          : " (" + std::to_string(r.spelled_differently.size()) + " spelled differently)";
  if (!r.Identical()) {
    print("different");
  } else if (r.AllValuesCompared()) {
    print("identical");
  } else if (r.values) {
    const size_t unknown = r.spelled_differently.size() + r.objects_not_compared.size();
    print("same keys" + spelled + ", shapes and dtypes; the values compared are equal; those of " +
          std::to_string(unknown) + " keys not compared");
  } else {
    print("same keys" + spelled + ", shapes and dtypes; values not compared");
  }
}

nlohmann::json SideJson(const Side& s) {
  nlohmann::json j = {{"kind", s.kind}};
  if (s.kind == "tensor") j["dtype"] = s.dtype, j["shape"] = s.shape;
  return j;
}

void PrintDiffJson(const std::string& path_a, const std::string& path_b, const DiffResult& r) {
  nlohmann::json doc;
  doc["a"] = path_a;
  doc["b"] = path_b;
  doc["identical"] = r.Identical() && r.AllValuesCompared();  // values compared and equal
  doc["same_keys_shapes_dtypes"] = r.Identical();
  doc["only_in_a"] = r.only_a;
  doc["only_in_b"] = r.only_b;
  doc["spelled_differently"] = nlohmann::json::array();
  for (const Spelling& s : r.spelled_differently) {
    doc["spelled_differently"].push_back(
        {{"key", s.key}, {"object_in", s.whole_in_a ? "a" : "b"}, {"elements", s.elements}});
  }
  doc["changed"] = nlohmann::json::array();
  for (const Change& c : r.changed) {
    doc["changed"].push_back({{"key", c.key}, {"a", SideJson(c.a)}, {"b", SideJson(c.b)}});
  }
  doc["metadata_changes"] = nlohmann::json::array();
  for (const auto& [k, va, vb] : r.metadata) {
    doc["metadata_changes"].push_back({{"key", k}, {"a", va}, {"b", vb}});
  }
  doc["values_compared"] = r.values;
  doc["differing_values"] = nlohmann::json::array();
  for (const auto& [key, d] : r.value_diffs) {
    nlohmann::json j = {{"key", key}, {"kind", d.object ? "object" : "tensor"}};
    if (!d.object) {
      j["elements_differing"] = d.elements_differing;
      j["max_abs_diff"] =
          std::isinf(d.max_abs_diff) ? nlohmann::json("inf") : nlohmann::json(d.max_abs_diff);
      j["nan_mismatch"] = d.nan_mismatch;
    }
    doc["differing_values"].push_back(std::move(j));
  }
  doc["objects_not_compared"] = nlohmann::json::array();
  for (const auto& [key, why] : r.objects_not_compared) {
    doc["objects_not_compared"].push_back({{"key", key}, {"why", why}});
  }
  doc["keys_compared"] = r.tensors_compared + r.objects_compared - r.objects_not_compared.size();
  doc["chunks_equal_by_checksum"] = r.chunks_skipped;
  PrintJson(std::move(doc));
}

// Exit codes: 0 identical, 1 different, 2 error, 3 same keys, shapes and dtypes with values not
// compared, or not all of them (keys spelled differently) (README, `tessera diff --help`).
constexpr int kIdentical = 0, kDifferent = 1, kError = 2, kValuesNotCompared = 3;

int Error(const Status& status) {
  Fail(status);
  return kError;
}

int RunDiff(const std::string& a, const std::string& b, bool values, bool json) {
  Result<Metadata> ma = ReadMetadata(a);
  if (!ma.ok()) return Error(ma.status());
  Result<Metadata> mb = ReadMetadata(b);
  if (!mb.ok()) return Error(mb.status());
  Result<DiffResult> r = Compare(a, *ma, b, *mb, values);
  if (!r.ok()) return Error(r.status().WithContext("comparing values"));
  if (json) {
    PrintDiffJson(a, b, *r);
  } else {
    PrintText(a, *ma, b, *mb, *r);
  }
  if (!r->Identical()) return kDifferent;
  return r->AllValuesCompared() ? kIdentical : kValuesNotCompared;
}

}  // namespace

void AddDiffCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<std::string>();
  auto b = std::make_shared<std::string>();
  auto values = std::make_shared<bool>(false);
  auto json = std::make_shared<bool>(false);
  CLI::App* diff = app.add_subcommand(
      "diff",
      "Compare two checkpoints: keys on one side only, dtype or shape changes, and with "
      "--values the tensors that differ. A list or tuple kept as one object on one side (torch "
      "DCP) and keyed per element on the other (tessera) is the same key spelled differently. "
      "Exit status: 0 identical (with --values), 1 different, 2 error, 3 same keys, shapes and "
      "dtypes but values not compared (no --values, or keys spelled differently)");
  diff->add_option("A", *a, "first checkpoint")->required();
  diff->add_option("B", *b, "second checkpoint")->required();
  diff->add_flag("--values", *values,
                 "also compare values, chunk by chunk (chunks with equal checksums are not read)");
  diff->add_flag("--json", *json, "print one JSON document");
  diff->callback([=] { *exit_code = RunDiff(*a, *b, *values, *json); });
}

}  // namespace tessera::tools
