// libFuzzer target: the restricted pickle reader and, on what it parses, the DCP .metadata
// interpretation. Any input gives a tree or an error; a .metadata that reads back must encode
// and read back to the same metadata. Corpus: fuzz/corpus/pickle/. Run: scripts/fuzz pickle.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "format/torch_dist/dcp_metadata.h"
#include "format/torch_dist/pickle.h"

namespace {

using tessera::torch_dist::PickleKind;
using tessera::torch_dist::PickleValue;

// Visits every node reachable from the root once (iteratively: cycles and depth are fine) and
// calls every accessor, which must stay in bounds whatever the node.
void Walk(const tessera::torch_dist::PickleTree& tree) {
  std::vector<PickleValue> todo = {tree.root()};
  std::vector<bool> seen(tree.node_count(), false);
  while (!todo.empty()) {
    const PickleValue v = todo.back();
    todo.pop_back();
    if (v.id() >= seen.size()) __builtin_trap();
    if (seen[v.id()]) continue;
    seen[v.id()] = true;
    (void)v.Describe();
    (void)v.AsInt();
    (void)v.AsStr();
    (void)v.AsBytes();
    (void)v.ObjectClass();
    (void)v.Attr("fqn");
    (void)tessera::torch_dist::DecodePickledBytes(v);
    for (size_t i = 0; i < v.size(); ++i) {
      if (v.is(PickleKind::kDict)) {
        todo.push_back(v.key(i));
        todo.push_back(v.value(i));
      } else {
        todo.push_back(v.item(i));
      }
    }
    if (v.is(PickleKind::kReduce) || v.is(PickleKind::kNewObj)) {
      todo.push_back(v.callable());
      todo.push_back(v.args());
      for (auto o : {v.kwargs(), v.state(), v.list_items(), v.dict_items()}) {
        if (o) todo.push_back(*o);
      }
    }
    if (v.is(PickleKind::kPersId)) todo.push_back(v.persistent_id());
    if (v.is(PickleKind::kGlobal) && v.global_module().size() > (1u << 30)) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  auto tree = tessera::torch_dist::ParsePickle(bytes, "fuzz.pkl");
  if (!tree.ok()) return 0;
  if (tree->end_offset() > size || tree->node_count() > size + 300) __builtin_trap();
  Walk(*tree);
  auto metadata = tessera::torch_dist::InterpretDcpMetadata(*tree);
  if (!metadata.ok()) return 0;
  // What reads must write, and read back the same (protocol 4, the flavour's class paths).
  tessera::torch_dist::DcpMetadata m = *metadata;
  if (m.planner_data_kind == tessera::torch_dist::DcpPlannerData::kOther) return 0;
  if (m.flavor == tessera::torch_dist::DcpFlavor::kTorch113 && (m.version || m.storage_meta)) {
    return 0;
  }
  auto encoded = tessera::torch_dist::EncodeDcpMetadata(m);
  if (!encoded.ok()) __builtin_trap();
  auto again = tessera::torch_dist::ReadDcpMetadata(*encoded, "fuzz.reencoded");
  if (!again.ok()) __builtin_trap();
  m.megatron_metadata_class = false;  // the writer always writes torch's Metadata class
  m.has_all_local_plans = false;      // and never writes all_local_plans
  if (!(*again == m)) __builtin_trap();
  return 0;
}
