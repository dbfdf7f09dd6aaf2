#include "format/torch_dist/dcp_metadata.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "format/torch_dist/pickle_writer.h"
#include "format/torch_dist/torch_dtype.h"

namespace tessera::torch_dist {
namespace {

// Class paths (docs/FORMAT_TORCH_DIST.md, ".metadata").
constexpr std::string_view kMetadata113 = "torch.distributed._shard.checkpoint.metadata";
constexpr std::string_view kMetadata2 = "torch.distributed.checkpoint.metadata";
constexpr std::string_view kFilesystem113 = "torch.distributed._shard.checkpoint.filesystem";
constexpr std::string_view kFilesystem2 = "torch.distributed.checkpoint.filesystem";
constexpr std::string_view kShardedTensorMetadata =
    "torch.distributed._shard.sharded_tensor.metadata";
constexpr std::string_view kMegatronPrefix = "megatron.core.dist_checkpointing";

constexpr std::string_view kMemFormatNames[] = {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST",
                                                "TORCH_PRESERVE_FORMAT"};

bool IsDcpObject(const PickleValue& v, std::string_view name) {
  return v.IsObjectOf(kMetadata113, name) || v.IsObjectOf(kMetadata2, name);
}

// Errors inside the interpretation are built bottom-up: each level prefixes its part of the
// path only when something failed, so the common path costs no string work.
Status At(const Status& s, std::string_view where) {
  return InvalidArgument(std::string(where) + ": " + s.message());
}
std::string Quoted(std::string_view s) { return "['" + std::string(s) + "']"; }
std::string Indexed(size_t i) { return "[" + std::to_string(i) + "]"; }

// What interpreting may materialise, counted against the size of the pickle (issue 22): a memo
// reference costs 2 to 5 bytes of the file, but each use of what it names is a copy here (a
// chunk list referenced by 100,000 keys is 100,000 lists), and each attribute lookup scans its
// object's state. Every copy (its bytes) and every scan (16 bytes per entry looked at) is
// charged; past the budget the interpretation stops with an error naming where it was and the
// offset of the value being copied.
class Budget {
 public:
  Budget(const PickleTree& tree, uint64_t limit) : tree_(tree), limit_(limit) {}

  Status Charge(uint64_t bytes, const PickleValue& from) {
    used_ += bytes;
    if (used_ <= limit_) [[likely]]
      return Status();
    std::string at;
    if (std::optional<uint64_t> offset = tree_.OffsetOf(from)) {
      at = "; stopped while reading the " + std::string(PickleKindName(from.kind())) +
           " at offset " + std::to_string(*offset);
    }
    return InvalidArgument(
        "the values this .metadata references expand to more than " + std::to_string(limit_) +
        " bytes when read (" + std::to_string(kDcpExpansionFactor) + " times its " +
        std::to_string(tree_.end_offset()) + " bytes, plus " +
        std::to_string(kDcpExpansionFloor >> 20) +
        " MiB): values it holds once are referenced again and again through the pickle memo, "
        "and each reference is a copy here" +
        at);
  }

 private:
  const PickleTree& tree_;
  const uint64_t limit_;
  uint64_t used_ = 0;
};

constexpr uint64_t kLookupCost = 16;  // per state entry an attribute lookup scans
constexpr uint64_t kStringCost = 32;  // a std::string, before its bytes
constexpr uint64_t kVectorCost = 24;  // a std::vector, before its elements

// The attribute `attr` of object `obj`, charging the scan of its state.
std::optional<PickleValue> Attr(Budget& b, const PickleValue& obj, std::string_view attr,
                                Status* status) {
  if (std::optional<PickleValue> state = obj.state()) {
    uint64_t entries = state->size();
    if (state->is(PickleKind::kTuple)) entries = state->item(0).size() + state->item(1).size();
    *status = b.Charge(kLookupCost * (entries + 1), *state);
    if (!status->ok()) return std::nullopt;
  }
  return obj.Attr(attr);
}

Result<PickleValue> Required(Budget& b, const PickleValue& obj, std::string_view attr,
                             std::string_view cls) {
  Status status;
  std::optional<PickleValue> v = Attr(b, obj, attr, &status);
  TESSERA_RETURN_IF_ERROR(status);
  if (!v) {
    return InvalidArgument("missing attribute '" + std::string(attr) + "' of " + std::string(cls));
  }
  return *v;
}

// An optional attribute: absent and None are both nullopt.
Result<std::optional<PickleValue>> Optional(Budget& b, const PickleValue& obj,
                                            std::string_view attr) {
  Status status;
  std::optional<PickleValue> v = Attr(b, obj, attr, &status);
  TESSERA_RETURN_IF_ERROR(status);
  if (!v || v->is_none()) return std::optional<PickleValue>();
  return v;
}

Result<std::vector<int64_t>> IntSequence(Budget& b, const PickleValue& v) {
  if (!v.is(PickleKind::kTuple) && !v.is(PickleKind::kList)) {
    return InvalidArgument("expected a tuple of ints, found " + v.Describe());
  }
  TESSERA_RETURN_IF_ERROR(b.Charge(kVectorCost + 8 * v.size(), v));
  std::vector<int64_t> out(v.size());
  for (size_t i = 0; i < out.size(); ++i) {
    Result<int64_t> x = v.item(i).AsInt();
    if (!x.ok()) return At(x.status(), Indexed(i));
    out[i] = *x;
  }
  return out;
}

// torch.Size is pickled as reduce(torch.Size, ((d0, d1, ...),)); a plain tuple is accepted too.
Result<std::vector<int64_t>> TorchSize(Budget& b, const PickleValue& v) {
  if (v.is(PickleKind::kReduce)) {
    if (!v.callable().IsGlobal("torch", "Size") || v.args().size() != 1) {
      return InvalidArgument("expected torch.Size, found " + v.Describe());
    }
    return IntSequence(b, v.args().item(0));
  }
  return IntSequence(b, v);
}

Result<std::string> Str(Budget& b, const PickleValue& v) {
  TESSERA_ASSIGN_OR_RETURN(std::string_view s, v.AsStr());
  TESSERA_RETURN_IF_ERROR(b.Charge(kStringCost + s.size(), v));
  return std::string(s);
}

Result<std::optional<std::string>> OptionalStr(Budget& b, const PickleValue& obj,
                                               std::string_view attr) {
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> v, Optional(b, obj, attr));
  if (!v) return std::optional<std::string>();
  Result<std::string> s = Str(b, *v);
  if (!s.ok()) return At(s.status(), attr);
  return std::optional<std::string>(*std::move(s));
}

class Interpreter {
 public:
  Interpreter(DcpMetadata* out, Budget* budget) : m_(*out), b_(*budget) {}

  Status Root(const PickleValue& root);

 private:
  Status StateDictMetadata(const PickleValue& dict);
  Status Tensor(const PickleValue& tsm, std::string fqn);
  Status Properties(const PickleValue& props, DcpTensor& t);
  Status StorageData(const PickleValue& dict);
  Status Storage(const PickleValue& index, const PickleValue& info);
  Status PlannerData(const PickleValue& v);
  Result<std::string> PathLike(const PickleValue& v);
  Status StorageMeta(const PickleValue& v);
  Status McoreData(const PickleValue& v);

  DcpMetadata& m_;
  Budget& b_;
  bool flavor_known_ = false;
};

Status Interpreter::Root(const PickleValue& root) {
  const std::optional<PickleValue> cls = root.ObjectClass();
  if (cls && cls->IsGlobal(kMetadata113, "Metadata")) {
    m_.flavor = DcpFlavor::kTorch113;
    flavor_known_ = true;
  } else if (cls && cls->IsGlobal(kMetadata2, "Metadata")) {
    m_.flavor = DcpFlavor::kTorch2;
    flavor_known_ = true;
  } else if (cls && cls->global_name() == "MCoreMetadata" &&
             cls->global_module().substr(0, kMegatronPrefix.size()) == kMegatronPrefix) {
    m_.megatron_metadata_class = true;  // the flavour comes from the classes inside
  } else {
    return InvalidArgument("the pickled object is " + root.Describe() +
                           ", not a DCP Metadata (torch.distributed.checkpoint.metadata."
                           "Metadata or torch.distributed._shard.checkpoint.metadata.Metadata)");
  }
  const std::string cls_name =
      std::string(cls->global_module()) + "." + std::string(cls->global_name());

  TESSERA_ASSIGN_OR_RETURN(PickleValue sdm, Required(b_, root, "state_dict_metadata", cls_name));
  TESSERA_RETURN_IF_ERROR(StateDictMetadata(sdm));
  TESSERA_ASSIGN_OR_RETURN(PickleValue sd, Required(b_, root, "storage_data", cls_name));
  TESSERA_RETURN_IF_ERROR(StorageData(sd));
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> pd, Optional(b_, root, "planner_data"));
  if (pd) TESSERA_RETURN_IF_ERROR(PlannerData(*pd));
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> v, Optional(b_, root, "version"));
  if (v) {
    Result<std::string> s = Str(b_, *v);
    if (!s.ok()) return At(s.status(), "version");
    m_.version = *std::move(s);
  }
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> sm, Optional(b_, root, "storage_meta"));
  if (sm) {
    Status s = StorageMeta(*sm);
    if (!s.ok()) return At(s, "storage_meta");
  }
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> md, Optional(b_, root, "mcore_data"));
  if (md) {
    Status s = McoreData(*md);
    if (!s.ok()) return At(s, "mcore_data");
  }
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> plans, Optional(b_, root, "all_local_plans"));
  m_.has_all_local_plans = plans.has_value();
  return Status();
}

Status Interpreter::StateDictMetadata(const PickleValue& dict) {
  if (!dict.is(PickleKind::kDict)) {
    return InvalidArgument("state_dict_metadata: expected a dict, found " + dict.Describe());
  }
  const size_t n = dict.size();
  for (size_t i = 0; i < n; ++i) {
    Result<std::string> fqn = Str(b_, dict.key(i));
    if (!fqn.ok()) return At(fqn.status(), "state_dict_metadata key " + Indexed(i));
    const PickleValue v = dict.value(i);
    const std::optional<PickleValue> cls = v.ObjectClass();
    if (cls && !flavor_known_ &&
        (cls->global_module() == kMetadata113 || cls->global_module() == kMetadata2)) {
      m_.flavor = cls->global_module() == kMetadata113 ? DcpFlavor::kTorch113 : DcpFlavor::kTorch2;
      flavor_known_ = true;
    }
    if (IsDcpObject(v, "BytesStorageMetadata")) {
      TESSERA_RETURN_IF_ERROR(b_.Charge(sizeof(DcpBytes), v));
      m_.bytes.push_back({*std::move(fqn), kNoDcpStorage});
    } else if (IsDcpObject(v, "TensorStorageMetadata")) {
      const std::string name = *fqn;
      Status s = Tensor(v, *std::move(fqn));
      if (!s.ok()) return At(s, "state_dict_metadata" + Quoted(name));
    } else {
      return InvalidArgument("state_dict_metadata" + Quoted(*fqn) +
                             ": expected "
                             "TensorStorageMetadata or BytesStorageMetadata, found " +
                             v.Describe());
    }
  }
  return Status();
}

Status Interpreter::Tensor(const PickleValue& tsm, std::string fqn) {
  constexpr std::string_view kCls = "TensorStorageMetadata";
  DcpTensor t;
  t.fqn = std::move(fqn);
  TESSERA_RETURN_IF_ERROR(b_.Charge(sizeof(DcpTensor), tsm));
  TESSERA_ASSIGN_OR_RETURN(PickleValue props, Required(b_, tsm, "properties", kCls));
  Status s = Properties(props, t);
  if (!s.ok()) return At(s, "properties");
  TESSERA_ASSIGN_OR_RETURN(PickleValue size, Required(b_, tsm, "size", kCls));
  Result<std::vector<int64_t>> sz = TorchSize(b_, size);
  if (!sz.ok()) return At(sz.status(), "size");
  t.size = *std::move(sz);
  TESSERA_ASSIGN_OR_RETURN(PickleValue chunks, Required(b_, tsm, "chunks", kCls));
  if (!chunks.is(PickleKind::kList) && !chunks.is(PickleKind::kTuple)) {
    return InvalidArgument("chunks: expected a list, found " + chunks.Describe());
  }
  s = b_.Charge(sizeof(DcpChunk) * chunks.size(), chunks);
  if (!s.ok()) return At(s, "chunks");
  t.chunks.resize(chunks.size());
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const PickleValue c = chunks.item(i);
    if (!IsDcpObject(c, "ChunkStorageMetadata")) {
      return InvalidArgument("chunks" + Indexed(i) + ": expected ChunkStorageMetadata, found " +
                             c.Describe());
    }
    for (const char* attr : {"offsets", "sizes"}) {
      Result<PickleValue> v = Required(b_, c, attr, "ChunkStorageMetadata");
      if (!v.ok()) return At(v.status(), "chunks" + Indexed(i));
      Result<std::vector<int64_t>> box = TorchSize(b_, *v);
      if (!box.ok()) return At(box.status(), "chunks" + Indexed(i) + "." + attr);
      (attr[0] == 'o' ? t.chunks[i].offsets : t.chunks[i].sizes) = *std::move(box);
    }
  }
  m_.tensors.push_back(std::move(t));
  return Status();
}

// TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory).
Status Interpreter::Properties(const PickleValue& props, DcpTensor& t) {
  if (!props.IsObjectOf(kShardedTensorMetadata, "TensorProperties") &&
      !props.IsObjectOf(kMetadata2, "TensorProperties")) {
    return InvalidArgument("expected TensorProperties, found " + props.Describe());
  }
  const std::optional<PickleValue> state = props.state();
  if (!state) return InvalidArgument("TensorProperties has no state");
  TESSERA_ASSIGN_OR_RETURN(PickleValue st, state->ExpectTuple(5));

  const PickleValue dtype = st.item(0);
  const TorchDType* td = dtype.is(PickleKind::kGlobal) && dtype.global_module() == "torch"
                             ? FindTorchDType(dtype.global_name())
                             : nullptr;
  if (td == nullptr) return InvalidArgument("unsupported dtype " + dtype.Describe());
  t.torch_dtype = std::string(td->name);

  const PickleValue layout = st.item(1);
  const bool strided =
      layout.IsGlobal("torch", "strided") ||
      (layout.is(PickleKind::kReduce) &&
       layout.callable().IsGlobal("torch.serialization", "_get_layout") &&
       layout.args().size() == 1 && layout.args().item(0).AsStr().value_or("") == "torch.strided");
  if (!strided) {
    return InvalidArgument("layout " + layout.Describe() +
                           " is not supported (only torch.strided)");
  }

  Result<bool> rg = st.item(2).AsBool();
  if (!rg.ok()) return At(rg.status(), "requires_grad");
  t.requires_grad = *rg;
  Result<bool> pin = st.item(4).AsBool();
  if (!pin.ok()) return At(pin.status(), "pin_memory");
  t.pin_memory = *pin;

  // The enum member: reduce(MEM_FORMAT_ENCODING, (value,)) or, from Python 3.11 on,
  // reduce(builtins.getattr, (MEM_FORMAT_ENCODING, "NAME")).
  const PickleValue mf = st.item(3);
  auto is_enum_class = [](const PickleValue& c) {
    return c.IsGlobal(kShardedTensorMetadata, "MEM_FORMAT_ENCODING") ||
           c.IsGlobal(kMetadata2, "_MEM_FORMAT_ENCODING") ||
           c.IsGlobal(kMetadata2, "MEM_FORMAT_ENCODING");
  };
  int encoding = -1;
  if (mf.is(PickleKind::kReduce) && mf.args().size() == 1 && is_enum_class(mf.callable())) {
    encoding = static_cast<int>(mf.args().item(0).AsInt().value_or(-1));
  } else if (mf.is(PickleKind::kReduce) &&
             (mf.callable().IsGlobal("builtins", "getattr") ||
              mf.callable().IsGlobal("__builtin__", "getattr")) &&  // protocol 2's name
             mf.args().size() == 2 &&
             is_enum_class(mf.args().item(0))) {
    const std::string_view name = mf.args().item(1).AsStr().value_or("");
    for (int i = 0; i < 3; ++i) {
      if (kMemFormatNames[i] == name) encoding = i;
    }
  }
  if (encoding < 0 || encoding > 2) {
    return InvalidArgument("memory_format: expected a MEM_FORMAT_ENCODING member, found " +
                           mf.Describe());
  }
  t.memory_format = static_cast<DcpMemoryFormat>(encoding);
  return Status();
}

Status Interpreter::StorageData(const PickleValue& dict) {
  if (!dict.is(PickleKind::kDict)) {
    return InvalidArgument("storage_data: expected a dict, found " + dict.Describe());
  }
  const size_t n = dict.size();
  m_.storage.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Status s = Storage(dict.key(i), dict.value(i));
    if (!s.ok()) return At(s, "storage_data" + Indexed(i));
  }
  return Status();
}

Status Interpreter::Storage(const PickleValue& index, const PickleValue& info) {
  if (!IsDcpObject(index, "MetadataIndex")) {
    return InvalidArgument("key: expected MetadataIndex, found " + index.Describe());
  }
  DcpStorage s;
  TESSERA_RETURN_IF_ERROR(b_.Charge(sizeof(DcpStorage), index));
  TESSERA_ASSIGN_OR_RETURN(PickleValue fqn, Required(b_, index, "fqn", "MetadataIndex"));
  Result<std::string> f = Str(b_, fqn);
  if (!f.ok()) return At(f.status(), "fqn");
  s.fqn = *std::move(f);
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> off, Optional(b_, index, "offset"));
  if (off) {
    Result<std::vector<int64_t>> o = TorchSize(b_, *off);
    if (!o.ok()) return At(o.status(), "MetadataIndex" + Quoted(s.fqn) + ".offset");
    s.offset = *std::move(o);
  }
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> hint, Optional(b_, index, "index"));
  if (hint) {
    Result<int64_t> h = hint->AsInt();
    if (!h.ok()) return At(h.status(), "MetadataIndex" + Quoted(s.fqn) + ".index");
    s.index = *h;
  }

  if (!info.IsObjectOf(kFilesystem113, "_StorageInfo") &&
      !info.IsObjectOf(kFilesystem2, "_StorageInfo")) {
    return InvalidArgument("value for " + s.fqn + ": expected _StorageInfo, found " +
                           info.Describe());
  }
  const std::string where = "_StorageInfo of " + s.fqn;
  TESSERA_ASSIGN_OR_RETURN(PickleValue path, Required(b_, info, "relative_path", where));
  Result<std::string> p = Str(b_, path);
  if (!p.ok()) return At(p.status(), where + ".relative_path");
  s.relative_path = *std::move(p);
  for (const char* attr : {"offset", "length"}) {
    TESSERA_ASSIGN_OR_RETURN(PickleValue v, Required(b_, info, attr, where));
    Result<int64_t> x = v.AsInt();
    if (!x.ok()) return At(x.status(), where + "." + attr);
    if (*x < 0) return InvalidArgument(where + "." + attr + " is negative: " + std::to_string(*x));
    (attr[0] == 'o' ? s.offset_in_file : s.length) = static_cast<uint64_t>(*x);
  }
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> td,
                           Optional(b_, info, "transform_descriptors"));
  if (td) {
    if (!td->is(PickleKind::kList) && !td->is(PickleKind::kTuple)) {
      return InvalidArgument(where + ".transform_descriptors: expected a list, found " +
                             td->Describe());
    }
    if (td->size() > 0) {
      std::string names;
      for (size_t i = 0; i < td->size() && i < 8; ++i) {
        names += (i ? ", '" : "'") + std::string(td->item(i).AsStr().value_or("?")) + "'";
      }
      if (td->size() > 8) names += ", ... (" + std::to_string(td->size()) + ")";
      return InvalidArgument(s.fqn + " is stored with transform_descriptors [" + names +
                             "]: compressed or transformed DCP items are not supported");
    }
  }
  m_.storage.push_back(std::move(s));
  return Status();
}

Status Interpreter::PlannerData(const PickleValue& v) {
  // torch 2.x flatten_state_dict: {fqn: (key, index, ...)}. Anything else is kept opaque.
  m_.planner_data_kind = DcpPlannerData::kOther;
  if (!v.is(PickleKind::kDict)) return Status();
  std::vector<DcpPlannerPath> paths(v.size());
  TESSERA_RETURN_IF_ERROR(b_.Charge(sizeof(DcpPlannerPath) * paths.size(), v));
  for (size_t i = 0; i < paths.size(); ++i) {
    const PickleValue k = v.key(i), p = v.value(i);
    if (!k.is(PickleKind::kStr) || (!p.is(PickleKind::kTuple) && !p.is(PickleKind::kList))) {
      return Status();
    }
    TESSERA_ASSIGN_OR_RETURN(paths[i].fqn, Str(b_, k));
    TESSERA_RETURN_IF_ERROR(b_.Charge(sizeof(DcpPathElement) * p.size(), p));
    for (size_t j = 0; j < p.size(); ++j) {
      const PickleValue e = p.item(j);
      if (e.is(PickleKind::kStr)) {
        TESSERA_ASSIGN_OR_RETURN(std::string element, Str(b_, e));
        paths[i].path.emplace_back(std::move(element));
      } else if (e.is(PickleKind::kInt)) {
        paths[i].path.emplace_back(*e.AsInt());
      } else {
        return Status();
      }
    }
  }
  m_.planner_data_kind = DcpPlannerData::kFlattenMapping;
  m_.planner_data = std::move(paths);
  return Status();
}

// A pathlib path is reduce(pathlib.PosixPath, (part, part, ...)). multi-storage-client's
// MultiStoragePath (its DCP writer's checkpoint_id) is newobj(cls) with the state
// {"_path": "msc://profile/path", "_internal_path": ...}: its path is "_path".
Result<std::string> Interpreter::PathLike(const PickleValue& v) {
  if (v.is(PickleKind::kStr)) return Str(b_, v);
  if (v.IsObjectOf("multistorageclient.pathlib", "MultiStoragePath")) {
    const std::optional<PickleValue> path = v.Attr("_path");
    if (path && path->is(PickleKind::kStr)) return Str(b_, *path);
    return InvalidArgument("expected a MultiStoragePath with a str _path, found " +
                           (path ? path->Describe() : std::string("none")));
  }
  const std::optional<PickleValue> cls = v.ObjectClass();
  const bool pathlib =
      cls && (cls->global_module() == "pathlib" || cls->global_module().substr(0, 8) == "pathlib.");
  if (!pathlib || !v.is(PickleKind::kReduce)) {
    return InvalidArgument("expected a str or a pathlib path, found " + v.Describe());
  }
  const PickleValue parts = v.args();
  std::string path;
  for (size_t i = 0; i < parts.size(); ++i) {
    TESSERA_ASSIGN_OR_RETURN(std::string_view part, parts.item(i).AsStr());
    TESSERA_RETURN_IF_ERROR(b_.Charge(part.size() + 1, parts));
    if (!path.empty() && path.back() != '/') path += '/';
    path += part;
  }
  return path;
}

Status Interpreter::StorageMeta(const PickleValue& v) {
  if (!v.IsObjectOf(kMetadata2, "StorageMeta")) {
    return InvalidArgument("expected StorageMeta, found " + v.Describe());
  }
  DcpStorageMeta sm;
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> id, Optional(b_, v, "checkpoint_id"));
  if (id) {
    Result<std::string> p = PathLike(*id);
    if (!p.ok()) return At(p.status(), "checkpoint_id");
    sm.checkpoint_id = *std::move(p);
  }
  TESSERA_ASSIGN_OR_RETURN(sm.save_id, OptionalStr(b_, v, "save_id"));
  TESSERA_ASSIGN_OR_RETURN(sm.load_id, OptionalStr(b_, v, "load_id"));
  TESSERA_ASSIGN_OR_RETURN(std::optional<PickleValue> mods, Optional(b_, v, "modules"));
  if (mods) {
    for (size_t i = 0; i < mods->size(); ++i) {
      Result<std::string> s = Str(b_, mods->item(i));
      if (!s.ok()) return At(s.status(), "modules" + Indexed(i));
      sm.modules.push_back(*std::move(s));
    }
  }
  m_.storage_meta = std::move(sm);
  return Status();
}

Status Interpreter::McoreData(const PickleValue& v) {
  if (!v.is(PickleKind::kDict)) return InvalidArgument("expected a dict, found " + v.Describe());
  m_.has_mcore_data = true;
  for (size_t i = 0; i < v.size(); ++i) {
    DcpMcoreEntry e;
    Result<std::string> key = Str(b_, v.key(i));
    if (!key.ok()) return At(key.status(), "key " + Indexed(i));
    e.key = *std::move(key);
    const PickleValue entry = v.value(i);
    if (!entry.is(PickleKind::kDict)) {
      return InvalidArgument(Quoted(e.key) + ": expected a dict, found " + entry.Describe());
    }
    TESSERA_RETURN_IF_ERROR(b_.Charge(sizeof(DcpMcoreEntry) + kLookupCost * entry.size(), entry));
    if (std::optional<PickleValue> shape = entry.Find("nd_reformulated_orig_global_shape")) {
      Result<std::vector<int64_t>> s = TorchSize(b_, *shape);
      if (!s.ok()) return At(s.status(), Quoted(e.key) + "['nd_reformulated_orig_global_shape']");
      e.nd_reformulated_orig_global_shape = *std::move(s);
    }
    m_.mcore_data.push_back(std::move(e));
  }
  return Status();
}

// ---- linking storage entries to chunks --------------------------------------------------------

std::string BoxText(std::span<const int64_t> v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}

std::string OffsetsKey(std::span<const int64_t> offsets) {
  return std::string(reinterpret_cast<const char*>(offsets.data()), offsets.size_bytes());
}

Status CheckChunk(const DcpTensor& t, size_t i) {
  const DcpChunk& c = t.chunks[i];
  auto where = [&] { return t.fqn + " chunk " + std::to_string(i) + " at " + BoxText(c.offsets); };
  if (c.offsets.size() != t.size.size() || c.sizes.size() != t.size.size()) {
    return InvalidArgument(where() + ": offsets " + BoxText(c.offsets) + " and sizes " +
                           BoxText(c.sizes) + " do not match the tensor's " +
                           std::to_string(t.size.size()) + " dimensions");
  }
  for (size_t d = 0; d < t.size.size(); ++d) {
    if (t.size[d] < 0 || c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] > t.size[d] ||
        c.sizes[d] > t.size[d] - c.offsets[d]) {
      return InvalidArgument(where() + ": box " + BoxText(c.offsets) + " + " + BoxText(c.sizes) +
                             " is not inside the tensor's size " + BoxText(t.size));
    }
  }
  return Status();
}

// Computes, without modifying `m`, which storage entry holds each chunk and bytes item.
Status Link(const DcpMetadata& m, std::vector<std::vector<size_t>>* chunk_storage,
            std::vector<size_t>* bytes_storage) {
  struct Item {
    bool is_tensor;
    size_t index;
  };
  std::unordered_map<std::string_view, Item> items;
  items.reserve(m.tensors.size() + m.bytes.size());
  chunk_storage->assign(m.tensors.size(), {});
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const DcpTensor& t = m.tensors[i];
    if (!items.emplace(t.fqn, Item{true, i}).second) {
      return InvalidArgument("fqn '" + t.fqn + "' appears twice in state_dict_metadata");
    }
    for (size_t c = 0; c < t.chunks.size(); ++c) TESSERA_RETURN_IF_ERROR(CheckChunk(t, c));
    (*chunk_storage)[i].assign(t.chunks.size(), kNoDcpStorage);
  }
  bytes_storage->assign(m.bytes.size(), kNoDcpStorage);
  for (size_t i = 0; i < m.bytes.size(); ++i) {
    if (!items.emplace(m.bytes[i].fqn, Item{false, i}).second) {
      return InvalidArgument("fqn '" + m.bytes[i].fqn + "' appears twice in state_dict_metadata");
    }
  }

  // Per tensor, built on the first hint that misses: chunk offsets -> chunk index.
  std::unordered_map<size_t, std::unordered_map<std::string, size_t>> by_offsets;
  for (size_t k = 0; k < m.storage.size(); ++k) {
    const DcpStorage& s = m.storage[k];
    auto it = items.find(s.fqn);
    if (it == items.end()) {
      return InvalidArgument("storage_data entry " + std::to_string(k) + " names '" + s.fqn +
                             "', which is not in state_dict_metadata");
    }
    if (!it->second.is_tensor) {
      if (s.offset) {
        return InvalidArgument("storage_data entry for bytes item '" + s.fqn + "' has an offset " +
                               BoxText(*s.offset));
      }
      size_t& slot = (*bytes_storage)[it->second.index];
      if (slot != kNoDcpStorage) {
        return InvalidArgument("two storage_data entries for bytes item '" + s.fqn + "'");
      }
      slot = k;
      continue;
    }
    const DcpTensor& t = m.tensors[it->second.index];
    if (!s.offset) {
      return InvalidArgument("storage_data entry for tensor '" + s.fqn + "' has no offset");
    }
    size_t chunk = kNoDcpStorage;
    if (s.index && *s.index >= 0 && static_cast<uint64_t>(*s.index) < t.chunks.size() &&
        t.chunks[*s.index].offsets == *s.offset) {
      chunk = static_cast<size_t>(*s.index);
    } else {
      auto& map = by_offsets[it->second.index];
      if (map.empty()) {
        for (size_t c = 0; c < t.chunks.size(); ++c)
          map.emplace(OffsetsKey(t.chunks[c].offsets), c);
      }
      auto found = map.find(OffsetsKey(*s.offset));
      if (found != map.end()) chunk = found->second;
    }
    if (chunk == kNoDcpStorage) {
      return InvalidArgument("storage_data entry for '" + s.fqn + "' at offset " +
                             BoxText(*s.offset) + " matches no chunk of the tensor");
    }
    size_t& slot = (*chunk_storage)[it->second.index][chunk];
    if (slot != kNoDcpStorage) {
      return InvalidArgument("two storage_data entries for '" + s.fqn + "' chunk at " +
                             BoxText(*s.offset));
    }
    slot = k;
  }

  for (size_t i = 0; i < m.tensors.size(); ++i) {
    for (size_t c = 0; c < m.tensors[i].chunks.size(); ++c) {
      if ((*chunk_storage)[i][c] == kNoDcpStorage) {
        return InvalidArgument("chunk of '" + m.tensors[i].fqn + "' at " +
                               BoxText(m.tensors[i].chunks[c].offsets) +
                               " has no storage_data entry");
      }
    }
  }
  for (size_t i = 0; i < m.bytes.size(); ++i) {
    if ((*bytes_storage)[i] == kNoDcpStorage) {
      return InvalidArgument("bytes item '" + m.bytes[i].fqn + "' has no storage_data entry");
    }
  }
  return Status();
}

// ---- writing ----------------------------------------------------------------------------------

struct ClassPaths {
  std::string_view metadata;    // Metadata, TensorStorageMetadata, ...
  std::string_view properties;  // TensorProperties and its memory format enum
  std::string_view mem_format_enum;
  std::string_view filesystem;  // _StorageInfo
};

ClassPaths PathsOf(DcpFlavor flavor) {
  if (flavor == DcpFlavor::kTorch113) {
    return {kMetadata113, kShardedTensorMetadata, "MEM_FORMAT_ENCODING", kFilesystem113};
  }
  return {kMetadata2, kMetadata2, "_MEM_FORMAT_ENCODING", kFilesystem2};
}

class Encoder {
 public:
  explicit Encoder(const DcpMetadata& m) : m_(m), p_(PathsOf(m.flavor)), w_(4) {}
  Result<std::vector<uint8_t>> Run();

 private:
  static constexpr size_t kBatch = 1000;  // items per SETITEMS/APPENDS, as CPython

  template <typename F>
  void Batched(size_t n, bool dict, F&& item) {
    for (size_t begin = 0; begin < n; begin += kBatch) {
      w_.Mark();
      for (size_t i = begin; i < std::min(n, begin + kBatch); ++i) item(i);
      dict ? w_.SetItems() : w_.Appends();
    }
  }
  // NEWOBJ(cls, ()) then a state dict built by `fields` (keys and values), as dataclasses pickle.
  template <typename F>
  void Object(std::string_view module, std::string_view name, F&& fields) {
    w_.GlobalMemo(module, name);
    w_.EmptyTuple();
    w_.NewObj();
    w_.EmptyDict();
    w_.Mark();
    fields();
    w_.SetItems();
    w_.Build();
  }
  void Size(std::span<const int64_t> v) {
    w_.GlobalMemo("torch", "Size");
    w_.IntTuple(v);
    w_.Tuple1();
    w_.Reduce();
  }
  void OptionalStr(const std::optional<std::string>& s) { s ? w_.Str(*s) : w_.None(); }
  Status Tensor(const DcpTensor& t);
  void Properties(const DcpTensor& t);
  void Storage(const DcpStorage& s);
  void PlannerData();
  void StorageMeta(const DcpStorageMeta& sm);
  void McoreData();

  const DcpMetadata& m_;
  ClassPaths p_;
  PickleWriter w_;
  uint32_t layout_memo_ = UINT32_MAX;
  uint32_t mem_format_memo_[3] = {UINT32_MAX, UINT32_MAX, UINT32_MAX};
};

Result<std::vector<uint8_t>> Encoder::Run() {
  if (m_.flavor == DcpFlavor::kTorch113 && (m_.version || m_.storage_meta)) {
    return InvalidArgument(
        "torch 1.13's DCP Metadata has no version or storage_meta: clear them or write the "
        "torch 2.x flavour");
  }
  if (m_.planner_data_kind == DcpPlannerData::kOther) {
    return InvalidArgument("planner_data of an unrecognised form cannot be written");
  }
  // The names every entry uses get 1-byte memo indices.
  for (std::string_view s : {"properties", "size", "chunks", "offsets", "sizes", "fqn", "index",
                             "offset", "relative_path", "length"}) {
    w_.Preload(s);
  }
  for (std::string_view cls :
       {"ChunkStorageMetadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata"}) {
    w_.PreloadGlobal(p_.metadata, cls);
  }
  w_.PreloadGlobal(p_.filesystem, "_StorageInfo");
  w_.PreloadGlobal("torch", "Size");
  w_.PreloadGlobal(p_.properties, "TensorProperties");

  Status status;
  w_.GlobalMemo(p_.metadata, "Metadata");
  w_.EmptyTuple();
  w_.NewObj();
  w_.EmptyDict();
  w_.Mark();
  w_.StrMemo("state_dict_metadata");
  w_.EmptyDict();
  Batched(m_.tensors.size() + m_.bytes.size(), true, [&](size_t i) {
    if (i < m_.tensors.size()) {
      w_.StrMemo(m_.tensors[i].fqn);
      if (Status s = Tensor(m_.tensors[i]); !s.ok() && status.ok()) status = s;
    } else {
      w_.StrMemo(m_.bytes[i - m_.tensors.size()].fqn);
      w_.GlobalMemo(p_.metadata, "BytesStorageMetadata");
      w_.EmptyTuple();
      w_.NewObj();
    }
  });
  TESSERA_RETURN_IF_ERROR(status);
  w_.StrMemo("planner_data");
  PlannerData();
  w_.StrMemo("storage_data");
  w_.EmptyDict();
  for (const DcpStorage& s : m_.storage) {
    if (s.offset_in_file > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        s.length > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return InvalidArgument("storage of '" + s.fqn + "': offset or length beyond 2^63");
    }
  }
  Batched(m_.storage.size(), true, [&](size_t i) { Storage(m_.storage[i]); });
  if (m_.flavor == DcpFlavor::kTorch2) {
    w_.StrMemo("storage_meta");
    m_.storage_meta ? StorageMeta(*m_.storage_meta) : w_.None();
    w_.StrMemo("version");
    OptionalStr(m_.version);
  }
  if (m_.has_mcore_data) {
    w_.StrMemo("mcore_data");
    McoreData();
  }
  w_.SetItems();
  w_.Build();
  w_.Stop();
  return w_.Take();
}

Status Encoder::Tensor(const DcpTensor& t) {
  const TorchDType* td = FindTorchDType(t.torch_dtype);
  if (td == nullptr) {
    return InvalidArgument("tensor '" + t.fqn + "': unknown torch dtype '" + t.torch_dtype + "'");
  }
  Object(p_.metadata, "TensorStorageMetadata", [&] {
    w_.StrMemo("properties");
    Properties(t);
    w_.StrMemo("size");
    Size(t.size);
    w_.StrMemo("chunks");
    w_.EmptyList();
    Batched(t.chunks.size(), false, [&](size_t i) {
      Object(p_.metadata, "ChunkStorageMetadata", [&] {
        w_.StrMemo("offsets");
        Size(t.chunks[i].offsets);
        w_.StrMemo("sizes");
        Size(t.chunks[i].sizes);
      });
    });
  });
  return Status();
}

// NEWOBJ(TensorProperties, ()) + BUILD with the 5-tuple of __getstate__.
void Encoder::Properties(const DcpTensor& t) {
  w_.GlobalMemo(p_.properties, "TensorProperties");
  w_.EmptyTuple();
  w_.NewObj();
  w_.Mark();
  w_.GlobalMemo("torch", FindTorchDType(t.torch_dtype)->name);
  if (layout_memo_ == UINT32_MAX) {
    w_.GlobalMemo("torch.serialization", "_get_layout");
    w_.StrMemo("torch.strided");
    w_.Tuple1();
    w_.Reduce();
    layout_memo_ = w_.Memoize();
  } else {
    w_.Get(layout_memo_);
  }
  w_.Bool(t.requires_grad);
  const int mf = static_cast<int>(t.memory_format);
  if (mem_format_memo_[mf] == UINT32_MAX) {
    // getattr(MEM_FORMAT_ENCODING, "NAME"): what Python 3.11+ writes for an enum member.
    w_.GlobalMemo("builtins", "getattr");
    w_.GlobalMemo(p_.properties, p_.mem_format_enum);
    w_.StrMemo(kMemFormatNames[mf]);
    w_.Tuple2();
    w_.Reduce();
    mem_format_memo_[mf] = w_.Memoize();
  } else {
    w_.Get(mem_format_memo_[mf]);
  }
  w_.Bool(t.pin_memory);
  w_.Tuple();
  w_.Build();
}

void Encoder::Storage(const DcpStorage& s) {
  // MetadataIndex's fields in the order its __init__ sets them: fqn, index, offset.
  Object(p_.metadata, "MetadataIndex", [&] {
    w_.StrMemo("fqn");
    w_.StrMemo(s.fqn);
    w_.StrMemo("index");
    s.index ? w_.Int(*s.index) : w_.None();
    if (s.offset) {
      w_.StrMemo("offset");
      Size(*s.offset);
    }
  });
  Object(p_.filesystem, "_StorageInfo", [&] {
    w_.StrMemo("relative_path");
    w_.StrMemo(s.relative_path);
    w_.StrMemo("offset");
    w_.Int(static_cast<int64_t>(s.offset_in_file));
    w_.StrMemo("length");
    w_.Int(static_cast<int64_t>(s.length));
  });
}

void Encoder::PlannerData() {
  if (m_.planner_data_kind == DcpPlannerData::kNone) {
    w_.None();
    return;
  }
  w_.EmptyDict();
  Batched(m_.planner_data.size(), true, [&](size_t i) {
    const DcpPlannerPath& p = m_.planner_data[i];
    w_.StrMemo(p.fqn);
    if (p.path.empty()) {
      w_.EmptyTuple();
      return;
    }
    if (p.path.size() > 3) w_.Mark();
    for (const DcpPathElement& e : p.path) {
      if (const std::string* s = std::get_if<std::string>(&e)) {
        w_.StrMemo(*s);
      } else {
        w_.Int(std::get<int64_t>(e));
      }
    }
    switch (p.path.size()) {
      case 1:
        w_.Tuple1();
        break;
      case 2:
        w_.Tuple2();
        break;
      case 3:
        w_.Tuple3();
        break;
      default:
        w_.Tuple();
        break;
    }
  });
}

void Encoder::StorageMeta(const DcpStorageMeta& sm) {
  Object(kMetadata2, "StorageMeta", [&] {
    w_.StrMemo("checkpoint_id");
    OptionalStr(sm.checkpoint_id);
    w_.StrMemo("save_id");
    OptionalStr(sm.save_id);
    w_.StrMemo("load_id");
    OptionalStr(sm.load_id);
    w_.StrMemo("modules");
    w_.EmptyList();
    Batched(sm.modules.size(), false, [&](size_t i) { w_.Str(sm.modules[i]); });
  });
}

void Encoder::McoreData() {
  w_.EmptyDict();
  Batched(m_.mcore_data.size(), true, [&](size_t i) {
    const DcpMcoreEntry& e = m_.mcore_data[i];
    w_.StrMemo(e.key);
    w_.EmptyDict();
    if (e.nd_reformulated_orig_global_shape) {
      w_.StrMemo("nd_reformulated_orig_global_shape");
      w_.IntTuple(*e.nd_reformulated_orig_global_shape);
      w_.SetItem();
    }
  });
}

}  // namespace

std::string_view DcpFlavorName(DcpFlavor flavor) {
  return flavor == DcpFlavor::kTorch113 ? "torch 1.13 (torch.distributed._shard.checkpoint)"
                                        : "torch 2.x (torch.distributed.checkpoint)";
}

uint64_t DcpExpansionBudget(uint64_t input_bytes) {
  return kDcpExpansionFactor * input_bytes + kDcpExpansionFloor;
}

Result<DcpMetadata> InterpretDcpMetadata(const PickleTree& tree) {
  DcpMetadata m;
  Budget budget(tree, DcpExpansionBudget(tree.end_offset()));
  Interpreter interpreter(&m, &budget);
  Status s = interpreter.Root(tree.root());
  if (s.ok()) s = LinkDcpStorage(m, tree.source());
  if (!s.ok()) {
    if (s.code() == StatusCode::kDataLoss) return s;
    return DataLoss(tree.source() + ": " + s.message());
  }
  return m;
}

Result<DcpMetadata> ReadDcpMetadata(std::span<const uint8_t> bytes, std::string_view source) {
  TESSERA_ASSIGN_OR_RETURN(PickleTree tree, ParsePickle(bytes, source));
  return InterpretDcpMetadata(tree);
}

Status LinkDcpStorage(DcpMetadata& metadata, std::string_view source) {
  std::vector<std::vector<size_t>> chunk_storage;
  std::vector<size_t> bytes_storage;
  Status s = Link(metadata, &chunk_storage, &bytes_storage);
  if (!s.ok()) return DataLoss(std::string(source) + ": " + s.message());
  for (size_t i = 0; i < metadata.tensors.size(); ++i) {
    for (size_t c = 0; c < metadata.tensors[i].chunks.size(); ++c) {
      metadata.tensors[i].chunks[c].storage = chunk_storage[i][c];
    }
  }
  for (size_t i = 0; i < metadata.bytes.size(); ++i) metadata.bytes[i].storage = bytes_storage[i];
  return Status();
}

Result<std::vector<uint8_t>> EncodeDcpMetadata(const DcpMetadata& metadata) {
  std::vector<std::vector<size_t>> chunk_storage;
  std::vector<size_t> bytes_storage;
  TESSERA_RETURN_IF_ERROR(Link(metadata, &chunk_storage, &bytes_storage));
  Encoder encoder(metadata);
  return encoder.Run();
}

}  // namespace tessera::torch_dist
