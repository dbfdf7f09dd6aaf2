// PyTorch element types as they appear in pickles: the dtype global `torch.<name>` (DCP
// TensorProperties, _rebuild_tensor_v3) and the legacy typed storage class
// `torch.<X>Storage` of a torch.save'd tensor (_rebuild_tensor_v2).
#ifndef TESSERA_FORMAT_TORCH_DIST_TORCH_DTYPE_H_
#define TESSERA_FORMAT_TORCH_DIST_TORCH_DTYPE_H_

#include <cstddef>
#include <optional>
#include <string_view>

#include "tessera/dtype.h"
#include "tessera/status.h"

namespace tessera::torch_dist {

struct TorchDType {
  std::string_view name;           // canonical: "float32", "bfloat16", "float8_e4m3fn", ...
  std::string_view storage_class;  // "FloatStorage", ...; empty for dtypes saved over an
                                   // untyped storage (_rebuild_tensor_v3: float8, uint16..64)
  size_t element_size;             // bytes
  std::optional<DType> dtype;      // tessera's element type; nullopt for complex
};

// By dtype name; accepts the canonical names and torch's aliases ("float", "double", "half",
// "long", "int", "short", "cfloat", "cdouble"). nullptr when unknown.
const TorchDType* FindTorchDType(std::string_view name);
// By typed storage class name ("FloatStorage"). nullptr when unknown (quantized storages...).
const TorchDType* FindTorchDTypeByStorageClass(std::string_view storage_class);
// The torch dtype of a tessera dtype (every tessera dtype has one).
const TorchDType& TorchDTypeOf(DType dtype);

// tessera's dtype for a torch dtype name; InvalidArgument naming the dtype when it has none.
Result<DType> DTypeFromTorchName(std::string_view name);

}  // namespace tessera::torch_dist

#endif  // TESSERA_FORMAT_TORCH_DIST_TORCH_DTYPE_H_
