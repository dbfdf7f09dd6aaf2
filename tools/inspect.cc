// tessera inspect / verify, and helpers the other commands share (commands.h).
#include <fnmatch.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <span>

#include <unistd.h>

#include "core/utf8.h"
#include "format/bounded_json.h"
#include "format/checkpoint_index.h"
#include "format/tessera/manifest.h"
#include "format/torch_dist/dcp_codec.h"
#include "format/torch_dist/pickle.h"
#include "tessera/checkpoint.h"
#include "tessera/storage_uri.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/progress.h"
#include "tools/text.h"

namespace tessera::tools {

int Fail(const Status& status) {
  // One line, whatever the message holds: a key's or a path's control characters (a hostile
  // checkpoint's terminal escapes) are printed \xNN, as the tables print them.
  std::fprintf(stderr, "tessera: error: %s\n", EscapeControlCharacters(status.ToString()).c_str());
  return 1;
}

Result<uint64_t> ParseSize(const std::string& text) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  std::string unit = end ? end : "";
  double scale = 0;
  if (unit.empty() || unit == "B")
    scale = 1;
  else if (unit == "KiB" || unit == "K")
    scale = 1024.0;
  else if (unit == "MiB" || unit == "M")
    scale = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "G")
    scale = 1024.0 * 1024 * 1024;
  else if (unit == "KB")
    scale = 1e3;
  else if (unit == "MB")
    scale = 1e6;
  else if (unit == "GB")
    scale = 1e9;
  if (end == text.c_str() || scale == 0 || !(value >= 0)) {
    return InvalidArgument("bad size '" + text + "': expected e.g. 256MiB, 1GiB, 1000000");
  }
  const double bytes = std::round(value * scale);
  // 2^64: the first double a uint64 cannot hold (also rejects inf).
  if (!(bytes < 18446744073709551616.0)) {
    return InvalidArgument("size '" + text + "' is too large (at most 2^64-1 bytes)");
  }
  return static_cast<uint64_t>(bytes);
}

Status CheckFitsInMemory(uint64_t bytes, const std::string& what) {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return Status::Ok();  // unknown: let the allocation decide
  const uint64_t memory = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  if (bytes <= memory) return Status::Ok();
  return InvalidArgument(what + " needs " + FormatBytes(bytes) + " of memory; this machine has " +
                         FormatBytes(memory));
}

Result<std::string> MakeBenchDir(const std::string& requested) {
  std::error_code ec;
  if (!requested.empty()) {
    std::filesystem::create_directories(requested, ec);
    if (ec) return IOError("creating " + requested + ": " + ec.message());
    return requested;
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/tessera-bench-XXXXXX";
  if (!mkdtemp(pattern.data())) return IOErrorFromErrno("mkdtemp " + pattern, errno);
  return pattern;
}

void RemoveBenchDir(const std::string& dir, const std::string& requested) {
  if (!requested.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

std::string FormatBytes(uint64_t bytes) {
  char buf[64];
  if (bytes >= 1000000000ull)
    std::snprintf(buf, sizeof(buf), "%.2f GB", bytes / 1e9);
  else if (bytes >= 1000000ull)
    std::snprintf(buf, sizeof(buf), "%.1f MB", bytes / 1e6);
  else if (bytes >= 1000ull)
    std::snprintf(buf, sizeof(buf), "%.1f kB", bytes / 1e3);
  else
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  return buf;
}

namespace {

constexpr char kStructureKey[] = "tessera.python.structure";
// Objects up to this size are read to show their value.
constexpr uint64_t kSmallObjectBytes = 256;

std::string EncodingName(ObjectEncoding e) {
  switch (e) {
    case ObjectEncoding::kBytes:
      return "bytes";
    case ObjectEncoding::kPickle:
      return "pickle";
    case ObjectEncoding::kTorchSave:
      return "torch.save";
    case ObjectEncoding::kJson:
      return "json";
  }
  return "?";
}

uint64_t TensorBytes(const TensorInfo& t) {
  uint64_t b = 0;
  for (const ChunkInfo& c : t.chunks) b += c.location.length;
  return b;
}

// Text without control characters, as it is; else "".
std::string PlainText(std::string_view s) {
  const std::string text(s);
  if (!IsValidUtf8(text)) return "";
  for (char c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return "";
  }
  return text;
}

// The value of a pickled Python scalar (None, bool, int, float, short str), as Python prints
// it; "" for anything else. Parsed by the inert reader: nothing is executed.
std::string PickledScalar(const std::vector<uint8_t>& bytes) {
  Result<torch_dist::PickleTree> tree = torch_dist::ParsePickle(std::span(bytes), "object");
  if (!tree.ok()) return "";
  const torch_dist::PickleValue v = tree->root();
  using torch_dist::PickleKind;
  switch (v.kind()) {
    case PickleKind::kNone:
      return "None";
    case PickleKind::kBool:
      return *v.AsBool() ? "True" : "False";
    case PickleKind::kInt:
      return std::to_string(*v.AsInt());
    case PickleKind::kFloat: {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.17g", *v.AsFloat());
      return buf;
    }
    case PickleKind::kStr: {
      const std::string text = PlainText(*v.AsStr());
      return text.empty() && !v.AsStr()->empty() ? "" : "'" + text + "'";
    }
    default:
      return "";
  }
}

// How a small object reads, or "" when it does not (binary, or a type not shown).
std::string ObjectValueText(const std::vector<uint8_t>& bytes, ObjectEncoding encoding) {
  const std::string_view raw(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  switch (encoding) {
    case ObjectEncoding::kPickle:
      return PickledScalar(bytes);
    case ObjectEncoding::kJson: {
      Result<nlohmann::json> doc = ParseBoundedJson(raw, "object");
      return doc.ok() ? doc->dump() : "";
    }
    case ObjectEncoding::kBytes: {
      const std::string text = PlainText(raw);
      return text.empty() ? "" : "'" + text + "'";
    }
    case ObjectEncoding::kTorchSave:
      return "";
  }
  return "";
}

// The values of the objects of `m` (those `shown`) up to kSmallObjectBytes, read with Load;
// empty when they cannot be read (inspect still shows the rest).
std::map<std::string, std::string> SmallObjectValues(
    const std::string& path, const Metadata& m, const std::vector<bool>& shown,
    const std::map<std::string, ObjectEncoding>& encodings) {
  StateDict state;
  for (size_t i = 0; i < m.objects.size(); ++i) {
    if (shown[m.tensors.size() + i] && m.objects[i].location.length <= kSmallObjectBytes) {
      (void)state.Add(ShardedObject{m.objects[i].key, {}, {}});
    }
  }
  std::map<std::string, std::string> values;
  if (state.entries().empty()) return values;
  LoadOptions options;
  options.missing_keys = KeyPolicy::kSkip;
  options.unexpected_keys = KeyPolicy::kSkip;
  if (!Load(state, path, options).ok()) return values;
  for (const StateEntry& entry : state.entries()) {
    const auto& object = std::get<ShardedObject>(entry);
    std::string text = ObjectValueText(object.data, encodings.at(object.key));
    if (!text.empty()) values[object.key] = std::move(text);
  }
  return values;
}

// What tessera's Python package records under kStructureKey: the containers and leaves of
// the state dict it saved (tessera/_state.py).
struct PythonStructure {
  bool parsed = false;
  uint64_t leaves = 0, containers = 0;
  // Object key -> "pickle", "bytes" or "bytearray": the package stores objects as bytes, and
  // says here which of them are pickles.
  std::map<std::string, std::string> object_encodings;
};

PythonStructure ParseStructure(const std::string& text) {
  PythonStructure out;
  Result<nlohmann::json> parsed = ParseBoundedJson(text, "structure");
  if (!parsed.ok()) return out;
  nlohmann::json& doc = *parsed;
  if (!doc.is_object() || !doc.contains("root")) return out;
  out.parsed = true;
  std::vector<const nlohmann::json*> stack = {&doc["root"]};
  while (!stack.empty()) {
    const nlohmann::json& node = *stack.back();
    stack.pop_back();
    if (!node.is_object()) continue;
    if (node.contains("tensor") || node.contains("object")) {
      ++out.leaves;
      if (node.contains("object") && node["object"].is_string() && node.contains("encoding") &&
          node["encoding"].is_string()) {
        out.object_encodings[node["object"]] = node["encoding"];
      }
      continue;
    }
    for (const char* kind : {"dict", "odict", "list", "tuple", "namedtuple"}) {
      if (!node.contains(kind) || !node[kind].is_array()) continue;
      ++out.containers;
      const bool pairs = std::string_view(kind) == "dict" || std::string_view(kind) == "odict";
      for (const nlohmann::json& child : node[kind]) {
        // A dict's children are [key, node] pairs.
        stack.push_back(pairs && child.is_array() && child.size() == 2 ? &child[1] : &child);
      }
    }
  }
  // Objects only other ranks held (merge_rank_summaries).
  if (doc.contains("extra") && doc["extra"].is_object() && doc["extra"].contains("objects") &&
      doc["extra"]["objects"].is_object()) {
    for (const auto& [key, encoding] : doc["extra"]["objects"].items()) {
      if (encoding.is_string()) out.object_encodings.emplace(key, encoding);
    }
  }
  return out;
}

// "<Python structure: 14 leaves, 5 containers, 2.1 kB>".
std::string SummariseStructure(const std::string& text) {
  const PythonStructure s = ParseStructure(text);
  const std::string size = FormatBytes(text.size());
  if (!s.parsed) return "<" + size + " of JSON>";
  return "<Python structure: " + std::to_string(s.leaves) + " leaves, " +
         std::to_string(s.containers) + " containers, " + size + ">";
}

// The encodings of `m`'s objects as they read: the manifest's, except that objects the Python
// package saved as bytes but recorded as pickles are pickles.
std::map<std::string, ObjectEncoding> EffectiveEncodings(const Metadata& m) {
  std::map<std::string, std::string> python;
  if (auto it = m.user_metadata.find(kStructureKey); it != m.user_metadata.end()) {
    python = ParseStructure(it->second).object_encodings;
  }
  std::map<std::string, ObjectEncoding> out;
  for (const ObjectInfo& o : m.objects) {
    auto p = python.find(o.key);
    out[o.key] = o.encoding == ObjectEncoding::kBytes && p != python.end() && p->second == "pickle"
                     ? ObjectEncoding::kPickle
                     : o.encoding;
  }
  return out;
}

// Prints `line` cut to the output width.
struct Printer {
  size_t width;
  void operator()(const std::string& line) const {
    std::printf("%s\n", FitEnd(line, width).c_str());
  }
};

// `rank_local`: the checkpoint is the merge of a rank-local save's rank manifests.
void PrintSummary(const std::string& path, const Metadata& m, bool rank_local,
                  const Printer& print) {
  print("checkpoint " + Printable(path));
  std::string format = CheckpointFormatName(m.format);
  if (m.format == CheckpointFormat::kTessera) {
    format += " (manifest version " + std::to_string(m.format_version) + ")";
  }
  if (m.checksum == ChecksumKind::kNone) format += " (no checksums)";
  if (!m.save_id.empty()) format += ", save id " + Printable(m.save_id);
  print("  format     " + format);
  if (rank_local) {
    print("  state      rank-local save, not finalized: " + std::to_string(m.num_ranks) +
          " rank manifests (tessera finalize merges them)");
  }
  std::string saved = FormatTime(m.save_time_unix_ms);
  saved = (saved == "-" ? "time unknown" : saved) + ", by " +
          (m.num_ranks > 0 ? std::to_string(m.num_ranks) : std::string("?")) +
          (m.num_ranks == 1 ? " rank" : " ranks");
  print("  saved      " + saved);
  uint64_t file_bytes = 0;  // shown too when well above the tensors' bytes
  for (const FileInfo& f : m.files) file_bytes += f.size;
  auto count = [](size_t n, const std::string& what) {
    return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
  };
  print("  contents   " + count(m.tensors.size(), "tensor") + " (" +
        count(m.TotalChunks(), "chunk") + "), " + count(m.objects.size(), "object") + ", " +
        FormatBytes(m.TotalTensorBytes()) + " in " + count(m.files.size(), "file") +
        (file_bytes > m.TotalTensorBytes() * 11 / 10 + (64u << 10)
             ? " of " + FormatBytes(file_bytes)
             : ""));
  if (!m.separate_prefixes.empty()) {
    std::string list;
    for (const std::string& p : m.separate_prefixes)
      list += (list.empty() ? "" : ", ") + Printable(p);
    print("  separate   " + list + " (in files of their own)");
  }
  const char* label = "  metadata   ";
  for (const auto& [k, v] : m.user_metadata) {
    // planner_data's paths (one per key of a DCP checkpoint) are summarised, not dumped.
    const std::string value = k == kStructureKey ? SummariseStructure(v)
                              : k == torch_dist::kPlannerPathsKey
                                  ? "(the path of each key in the nested state dict torch saved)"
                                  : Printable(v);
    print(label + Printable(k) + " = " + value);
    label = "             ";
  }
}

// One row of the key listing.
struct Row {
  std::string key, dtype, shape, chunks, bytes, value;
};

void PrintRows(const std::vector<Row>& rows, const Printer& print) {
  const size_t width = print.width;
  Row head{"KEY", "DTYPE", "SHAPE", "CHUNKS", "BYTES", ""};
  size_t dtype_w = 5, shape_w = 5, chunks_w = 6, bytes_w = 5;
  for (const Row& r : rows) {
    dtype_w = std::max(dtype_w, DisplayWidth(r.dtype));
    shape_w = std::max(shape_w, DisplayWidth(r.shape));
    chunks_w = std::max(chunks_w, DisplayWidth(r.chunks));
    bytes_w = std::max(bytes_w, DisplayWidth(r.bytes));
  }
  shape_w = std::min<size_t>(shape_w, 28);  // longer shapes are cut in the middle
  const size_t rest = 2 + dtype_w + 2 + shape_w + 2 + chunks_w + 2 + bytes_w;
  // The key column: as wide as the longest key that fits beside the columns and a short
  // value; longer keys get lines of their own.
  size_t value_room = 0;
  for (const Row& r : rows) {
    if (!r.value.empty())
      value_room = std::max(value_room, 4 + std::min<size_t>(DisplayWidth(r.value), 12));
  }
  const size_t room = width > rest + value_room ? width - rest - value_room : 0;
  size_t key_w = 16;
  for (const Row& r : rows) {
    if (DisplayWidth(r.key) <= room) key_w = std::max(key_w, DisplayWidth(r.key));
  }
  auto columns = [&](const Row& r) {
    return "  " + PadRight(r.dtype, dtype_w) + "  " +
           PadRight(FitMiddle(r.shape, shape_w), shape_w) + "  " + PadLeft(r.chunks, chunks_w) +
           "  " + PadLeft(r.bytes, bytes_w);
  };
  print(PadRight(head.key, key_w) + columns(head));
  for (const Row& r : rows) {
    std::string line;
    if (DisplayWidth(r.key) <= key_w) {
      line = PadRight(r.key, key_w) + columns(r);
    } else {
      // A key longer than its column gets lines of its own (wrapped, never cut), its columns
      // the next line.
      for (const std::string& piece : Wrap(r.key, width)) print(piece);
      line = std::string(key_w, ' ') + columns(r);
    }
    if (r.value.empty()) {
      print(line);
    } else if (DisplayWidth(line) + 4 + std::min<size_t>(DisplayWidth(r.value), 12) <= width) {
      print(line + "  = " + FitEnd(r.value, width - DisplayWidth(line) - 4));
    } else {  // no room at the end: the value on a line of its own, under the columns
      print(line);
      print(std::string(key_w + 2, ' ') + "= " + r.value);
    }
  }
}

// A node of the --tree view: one dotted component (or several, when a chain has one child).
struct TreeNode {
  std::string name;
  std::map<std::string, TreeNode> children;
  uint64_t keys = 0, bytes = 0;
  const Row* row = nullptr;  // when a key ends here
};

void AddToTree(TreeNode& root, const Row& row, uint64_t bytes) {
  TreeNode* node = &root;
  node->keys += 1, node->bytes += bytes;
  size_t begin = 0;
  while (true) {
    const size_t dot = row.key.find('.', begin);
    const std::string part = row.key.substr(begin, dot == std::string::npos ? dot : dot - begin);
    node = &node->children[part];
    node->name = part;
    node->keys += 1, node->bytes += bytes;
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  node->row = &row;
}

// Merges chains of single children that hold no key: "embedding.word_embeddings.weight".
void CollapseChains(TreeNode& node) {
  for (auto& [_, child] : node.children) CollapseChains(child);
  if (node.children.size() == 1 && node.row == nullptr && !node.name.empty()) {
    TreeNode only = std::move(node.children.begin()->second);
    only.name = node.name + "." + only.name;
    node = std::move(only);
  }
}

struct TreeLayout {
  size_t name_w, keys_w = 4, bytes_w = 9;
  int max_depth;
};

void PrintTreeNode(const TreeNode& node, int depth, const TreeLayout& layout,
                   const Printer& print) {
  std::vector<const TreeNode*> children;
  for (const auto& [_, child] : node.children) children.push_back(&child);
  std::sort(children.begin(), children.end(),
            [](const TreeNode* a, const TreeNode* b) { return NaturalLess(a->name, b->name); });
  for (const TreeNode* child : children) {
    const std::string indent(2 * depth, ' ');
    const bool expand = layout.max_depth <= 0 || depth + 1 < layout.max_depth;
    std::string line =
        PadRight(FitMiddle(indent + Printable(child->name), layout.name_w), layout.name_w) + "  " +
        PadLeft(std::to_string(child->keys), layout.keys_w) + "  " +
        PadLeft(FormatBytes(child->bytes), layout.bytes_w);
    if (child->row) line += "  " + child->row->dtype + " " + child->row->shape;
    if (!expand && !child->children.empty()) line += "  ...";
    print(line);
    if (expand) PrintTreeNode(*child, depth + 1, layout, print);
  }
}

void PrintTree(const std::vector<Row>& rows, const std::vector<uint64_t>& bytes, int max_depth,
               const Printer& print) {
  TreeNode root;
  for (size_t i = 0; i < rows.size(); ++i) AddToTree(root, rows[i], bytes[i]);
  for (auto& [_, child] : root.children) CollapseChains(child);
  // The name column: as wide as the widest indented name, leaving room for the numbers and a
  // short dtype and shape.
  size_t widest = 4;
  std::vector<std::pair<const TreeNode*, int>> stack;
  for (const auto& [_, child] : root.children) stack.push_back({&child, 0});
  while (!stack.empty()) {
    auto [node, depth] = stack.back();
    stack.pop_back();
    if (max_depth > 0 && depth >= max_depth) continue;
    widest = std::max(widest, 2 * depth + DisplayWidth(node->name));
    for (const auto& [_, child] : node->children) stack.push_back({&child, depth + 1});
  }
  TreeLayout layout{std::min(widest, print.width > 50 ? print.width - 40 : size_t{10}), 4, 9,
                    max_depth};
  print(PadRight("KEY", layout.name_w) + "  " + PadLeft("KEYS", layout.keys_w) + "  " +
        PadLeft("BYTES", layout.bytes_w));
  PrintTreeNode(root, 0, layout, print);
}

// Whether `key` matches one of `globs` (fnmatch: '*' also matches '.'); true without globs.
bool Selected(const std::string& key, const std::vector<std::string>& globs) {
  if (globs.empty()) return true;
  return std::any_of(globs.begin(), globs.end(),
                     [&](const std::string& g) { return fnmatch(g.c_str(), key.c_str(), 0) == 0; });
}

int PrintInspectJson(const std::string& path, const Metadata& m, const std::vector<bool>& shown,
                     const std::map<std::string, std::string>& values,
                     const std::map<std::string, ObjectEncoding>& encodings) {
  // Strings that are not UTF-8 (a corrupt or foreign index) print as PrintJson documents.
  nlohmann::json doc;
  doc["path"] = path;
  doc["format"] = CheckpointFormatName(m.format);
  doc["checksums"] = m.checksum != ChecksumKind::kNone;
  doc["format_version"] = m.format_version;
  doc["save_id"] = m.save_id;
  doc["commit"] = m.commit_seq;  // the directory's commit number (format version 3; 0 before)
  doc["num_ranks"] = m.num_ranks;
  doc["save_time_unix_ms"] = m.save_time_unix_ms;
  doc["total_bytes"] = m.TotalTensorBytes();
  doc["total_chunks"] = m.TotalChunks();
  doc["user_metadata"] = m.user_metadata;
  doc["separate_prefixes"] = m.separate_prefixes;
  auto& tensors = doc["tensors"] = nlohmann::json::array();
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (!shown[i]) continue;
    const TensorInfo& t = m.tensors[i];
    std::set<uint32_t> files;
    for (const ChunkInfo& c : t.chunks) files.insert(c.location.file_index);
    tensors.push_back({{"key", t.key},
                       {"dtype", std::string(DTypeName(t.dtype))},
                       {"shape", t.global_shape},
                       {"chunks", t.chunks.size()},
                       {"bytes", TensorBytes(t)},
                       {"files", files.size()}});
  }
  auto& objects = doc["objects"] = nlohmann::json::array();
  for (size_t i = 0; i < m.objects.size(); ++i) {
    if (!shown[m.tensors.size() + i]) continue;
    const ObjectInfo& o = m.objects[i];
    nlohmann::json object = {{"key", o.key},
                             {"bytes", o.location.length},
                             {"encoding", EncodingName(encodings.at(o.key))},
                             {"file", m.files[o.location.file_index].name}};
    if (auto it = values.find(o.key); it != values.end()) object["value"] = it->second;
    objects.push_back(std::move(object));
  }
  auto& files = doc["files"] = nlohmann::json::array();
  for (const FileInfo& f : m.files) files.push_back({{"name", f.name}, {"bytes", f.size}});
  PrintJson(std::move(doc));
  return 0;
}

}  // namespace

int RunInspect(const InspectOptions& options) {
  // A path or a URI (s3://bucket/ckpt, msc://profile/ckpt, file:///ckpt).
  Result<std::pair<std::shared_ptr<Storage>, std::string>> location = OpenStorage(options.path);
  if (!location.ok()) return Fail(location.status());
  Result<CheckpointIndex> index = ReadCheckpointIndex(*location->first, location->second);
  if (!index.ok()) return Fail(index.status());
  const Metadata& m = index->metadata;
  // Which keys are shown: tensors, then objects.
  std::vector<bool> shown;
  size_t num_shown = 0;
  for (const TensorInfo& t : m.tensors) shown.push_back(Selected(t.key, options.keys));
  for (const ObjectInfo& o : m.objects) shown.push_back(Selected(o.key, options.keys));
  for (bool s : shown) num_shown += s;
  const std::map<std::string, ObjectEncoding> encodings = EffectiveEncodings(m);
  const std::map<std::string, std::string> values =
      SmallObjectValues(options.path, m, shown, encodings);
  if (options.json) return PrintInspectJson(options.path, m, shown, values, encodings);

  const Printer print{static_cast<size_t>(std::max(OutputWidth(), 20))};
  PrintSummary(options.path, m, index->rank_local, print);
  std::vector<Row> rows;
  std::vector<uint64_t> bytes;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (!shown[i]) continue;
    const TensorInfo& t = m.tensors[i];
    rows.push_back({Printable(t.key), std::string(DTypeName(t.dtype)),
                    ShapeToString(t.global_shape), std::to_string(t.chunks.size()),
                    FormatBytes(TensorBytes(t)), ""});
    bytes.push_back(TensorBytes(t));
  }
  for (size_t i = 0; i < m.objects.size(); ++i) {
    if (!shown[m.tensors.size() + i]) continue;
    const ObjectInfo& o = m.objects[i];
    auto value = values.find(o.key);
    rows.push_back({Printable(o.key), "object", EncodingName(encodings.at(o.key)), "-",
                    FormatBytes(o.location.length), value == values.end() ? "" : value->second});
    bytes.push_back(o.location.length);
  }
  // Natural order: layers.2 before layers.10.
  std::vector<size_t> order(rows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return NaturalLess(rows[a].key, rows[b].key); });
  std::vector<Row> sorted_rows;
  std::vector<uint64_t> sorted_bytes;
  for (size_t i : order) sorted_rows.push_back(rows[i]), sorted_bytes.push_back(bytes[i]);
  print("");
  if (!options.keys.empty()) {
    print(std::to_string(num_shown) + " of " + std::to_string(shown.size()) + " keys match");
  }
  if (options.tree) {
    PrintTree(sorted_rows, sorted_bytes, options.depth, print);
  } else {
    PrintRows(sorted_rows, print);
  }
  if (options.files) {
    print("");
    size_t name_w = 4;
    for (const FileInfo& f : m.files) name_w = std::max(name_w, DisplayWidth(Printable(f.name)));
    name_w = std::min(name_w, print.width > 12 ? print.width - 12 : 4);
    print(PadRight("FILE", name_w) + "  " + PadLeft("BYTES", 9));
    for (const FileInfo& f : m.files) {
      print(PadRight(FitMiddle(Printable(f.name), name_w), name_w) + "  " +
            PadLeft(FormatBytes(f.size), 9));
    }
  }
  return 0;
}

int RunVerify(const std::string& path, int threads, ProgressMode progress) {
  ProgressBar bar("verify", progress);
  VerifyOptions options{.num_threads = threads};
  if (bar.active()) options.progress = bar.Callback();
  Result<VerifyReport> report = Verify(path, options);
  bar.Finish();
  if (!report.ok()) return Fail(report.status());
  if (!report->checksums) {
    // Nothing to check the bytes against: say so rather than claim they were checked.
    std::printf(
        "verified %s (%s): structure only, the format has no checksums: %llu chunks in %d "
        "files, every header consistent, every tensor covered exactly\n",
        Printable(path).c_str(), CheckpointFormatName(report->format),
        static_cast<unsigned long long>(report->chunks_checked), report->files_checked);
    return 0;
  }
  // PyTorch DCP: the CRC-32 of every zip record of every item (issue 22).
  const bool crc = report->format == CheckpointFormat::kTorchDist;
  std::printf("verified %s%s: %llu chunks, %s in %d files; %s, every tensor covered exactly\n",
              Printable(path).c_str(), crc ? " (torch_dist)" : "",
              static_cast<unsigned long long>(report->chunks_checked),
              FormatBytes(report->bytes_checked).c_str(), report->files_checked,
              crc ? "the CRC-32 of every zip record matches" : "checksums match");
  return 0;
}

void AddInspectCommands(CLI::App& app, int* exit_code) {
  auto options = std::make_shared<InspectOptions>();
  CLI::App* inspect = app.add_subcommand(
      "inspect", "Summarise a checkpoint and list its tensors and objects, one line per key");
  inspect->add_option("PATH", options->path, "checkpoint directory")->required();
  inspect->add_flag("--json", options->json, "print one JSON document (lines of any length)");
  inspect->add_option("--keys", options->keys,
                      "only keys matching this glob, e.g. 'decoder.layers.1.*' (repeatable)");
  inspect->add_flag("--tree", options->tree,
                    "group keys by dotted prefix, with the keys and bytes under each");
  inspect->add_option("--depth", options->depth, "with --tree: levels shown (0: all)")
      ->capture_default_str();
  inspect->add_flag("--files", options->files, "also list the data files");
  inspect->callback([=] { *exit_code = RunInspect(*options); });

  auto verify_path = std::make_shared<std::string>();
  CLI::App* verify = app.add_subcommand(
      "verify", "Re-read every chunk, check checksums and that chunks cover each tensor exactly");
  verify->add_option("PATH", *verify_path, "checkpoint directory")->required();
  auto verify_threads = std::make_shared<int>(VerifyOptions().num_threads);
  verify->add_option("--threads", *verify_threads, "data files checked at once")
      ->capture_default_str();
  auto progress = std::make_shared<ProgressFlags>();
  AddProgressFlags(*verify, *progress);
  verify->callback(
      [=] { *exit_code = RunVerify(*verify_path, *verify_threads, progress->Mode()); });
}

}  // namespace tessera::tools
