// Options that belong to one checkpoint format, held by the one `format_options` field of
// SaveOptions and ConvertOptions: nothing (std::monostate, the default: the format's defaults)
// or the options struct of the format written. Options of another format than the one written
// are refused (InvalidArgument naming the field and both formats), never ignored.
//
//   SaveOptions options;
//   options.format = CheckpointFormat::kTorchDist;
//   options.format_options = TorchDistOptions{.flavor = TorchDistFlavor::kTorch113};
//
// The formats without options of their own (tessera, Hugging Face safetensors) have no struct
// here. A format that gains options adds its struct and one alternative to FormatOptions.
#ifndef TESSERA_FORMATS_H_
#define TESSERA_FORMATS_H_

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace tessera {

// The class paths of the `.metadata` pickle of a torch_dist output (the numeric values are not
// written to disk).
enum class TorchDistFlavor {
  kTorch2,    // torch.distributed.checkpoint.* (torch 2.x), with version, storage_meta and
              // planner_data (default)
  kTorch113,  // torch.distributed._shard.checkpoint.* (torch 1.13), which torch 2.x cannot
              // unpickle; 1.13 lacks float8 and uint16/32/64, so an output holding them fails
              // (naming the tensor) before anything is written
};

// One element of the path of a key in a nested state dict: a dict key or a list index (PyTorch
// DCP's planner_data, torch's OBJ_PATH).
using TorchDistPathElement = std::variant<std::string, int64_t>;

// CheckpointFormat::kTorchDist: PyTorch DCP, as Megatron-Core's torch_dist backend writes it
// (docs/FORMAT_TORCH_DIST.md).
struct TorchDistOptions {
  // Which torch's class paths the `.metadata` uses. Default kTorch2.
  TorchDistFlavor flavor = TorchDistFlavor::kTorch2;
  // With kTorch2: the path of each key in the caller's nested state dict (dict keys and list
  // indices: {"model.fc.weight": {"model", "fc.weight"}}), written as the `.metadata`'s
  // planner_data, from which torch's dcp_to_torch_save and _load_state_dict_from_keys rebuild
  // the nesting. A key without a path here gets (key,), as for a flat state dict. Save: rank
  // 0's is used (Python's save fills it from the state dict). Default none.
  std::map<std::string, std::vector<TorchDistPathElement>> key_paths;
};

// The options of the format written: none (its defaults) or its struct above.
using FormatOptions = std::variant<std::monostate, TorchDistOptions>;

}  // namespace tessera

#endif  // TESSERA_FORMATS_H_
