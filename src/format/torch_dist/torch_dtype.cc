#include "format/torch_dist/torch_dtype.h"

#include <string>

namespace tessera::torch_dist {
namespace {

constexpr TorchDType kTorchDTypes[] = {
    {"float32", "FloatStorage", 4, DType::kF32},
    {"float64", "DoubleStorage", 8, DType::kF64},
    {"float16", "HalfStorage", 2, DType::kF16},
    {"bfloat16", "BFloat16Storage", 2, DType::kBF16},
    {"int64", "LongStorage", 8, DType::kI64},
    {"int32", "IntStorage", 4, DType::kI32},
    {"int16", "ShortStorage", 2, DType::kI16},
    {"int8", "CharStorage", 1, DType::kI8},
    {"uint8", "ByteStorage", 1, DType::kU8},
    {"bool", "BoolStorage", 1, DType::kBool},
    {"complex64", "ComplexFloatStorage", 8, std::nullopt},
    {"complex128", "ComplexDoubleStorage", 16, std::nullopt},
    // No legacy typed storage: torch 2.x saves these with _rebuild_tensor_v3.
    {"float8_e4m3fn", "", 1, DType::kF8E4M3},
    {"float8_e5m2", "", 1, DType::kF8E5M2},
    {"uint16", "", 2, DType::kU16},
    {"uint32", "", 4, DType::kU32},
    {"uint64", "", 8, DType::kU64},
};

struct Alias {
  std::string_view alias, name;
};
constexpr Alias kAliases[] = {{"float", "float32"},    {"double", "float64"},
                              {"half", "float16"},     {"long", "int64"},
                              {"int", "int32"},        {"short", "int16"},
                              {"cfloat", "complex64"}, {"cdouble", "complex128"}};

}  // namespace

const TorchDType* FindTorchDType(std::string_view name) {
  for (const Alias& a : kAliases) {
    if (a.alias == name) name = a.name;
  }
  for (const TorchDType& t : kTorchDTypes) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const TorchDType* FindTorchDTypeByStorageClass(std::string_view storage_class) {
  if (storage_class.empty()) return nullptr;
  for (const TorchDType& t : kTorchDTypes) {
    if (t.storage_class == storage_class) return &t;
  }
  return nullptr;
}

const TorchDType& TorchDTypeOf(DType dtype) {
  for (const TorchDType& t : kTorchDTypes) {
    if (t.dtype == dtype) return t;
  }
  return kTorchDTypes[0];  // unreachable: every DType is in the table (torch_dist_test checks)
}

Result<DType> DTypeFromTorchName(std::string_view name) {
  const TorchDType* t = FindTorchDType(name);
  if (t == nullptr) return InvalidArgument("unknown torch dtype '" + std::string(name) + "'");
  if (!t->dtype) {
    return InvalidArgument("torch dtype '" + std::string(t->name) + "' has no tessera counterpart");
  }
  return *t->dtype;
}

}  // namespace tessera::torch_dist
