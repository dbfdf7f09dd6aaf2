// Element types. The names are safetensors' dtype names, so a data file header needs no table.
#ifndef TESSERA_DTYPE_H_
#define TESSERA_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tessera/status.h"

namespace tessera {

// The numeric values are written to the manifest: they are permanent. Never renumber; only
// append new values.
enum class DType : uint8_t {
  kF64 = 1,
  kF32 = 2,
  kF16 = 3,
  kBF16 = 4,
  kF8E4M3 = 5,  // float8_e4m3fn
  kF8E5M2 = 6,
  kI64 = 7,
  kI32 = 8,
  kI16 = 9,
  kI8 = 10,
  kU8 = 11,
  kBool = 12,
  kU16 = 13,
  kU32 = 14,
  kU64 = 15,
};

// Every defined dtype, in numeric order.
inline constexpr DType kAllDTypes[] = {DType::kF64,    DType::kF32,    DType::kF16, DType::kBF16,
                                       DType::kF8E4M3, DType::kF8E5M2, DType::kI64, DType::kI32,
                                       DType::kI16,    DType::kI8,     DType::kU8,  DType::kBool,
                                       DType::kU16,    DType::kU32,    DType::kU64};

// Bytes per element.
size_t DTypeSize(DType dtype);
// The safetensors name: "F32", "BF16", "F8_E4M3", "BOOL", ...
std::string_view DTypeName(DType dtype);
// Inverse of DTypeName.
Result<DType> DTypeFromName(std::string_view name);
// True for a value that names a defined dtype (used when decoding a manifest).
bool IsValidDType(uint8_t value);

}  // namespace tessera

#endif  // TESSERA_DTYPE_H_
