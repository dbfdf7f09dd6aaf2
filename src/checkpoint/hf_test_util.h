// Test-only helpers: Hugging Face safetensors files written by an independent writer
// (src/format/huggingface/testdata/write_hf.py, Python's standard library only), the byte
// pattern it fills tensors with, and raw files for the error cases.
#ifndef TESSERA_CHECKPOINT_HF_TEST_UTIL_H_
#define TESSERA_CHECKPOINT_HF_TEST_UTIL_H_

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "format/torch_dist/test_util.h"
#include "tessera/box.h"
#include "tessera/dtype.h"

namespace tessera::hf_testing {

struct TensorSpec {
  std::string name;
  std::string dtype;  // safetensors name: "F32", "BF16", ...
  Shape shape;
};

// write_hf.py's pattern: byte i of tensor `name` is (seed + 167 i + (i >> 9)) mod 256, with
// seed = sum of (j + 1) * byte j of the name.
inline std::vector<uint8_t> PatternBytes(const std::string& name, uint64_t n) {
  uint64_t seed = 0;
  for (size_t j = 0; j < name.size(); ++j) seed += (j + 1) * static_cast<uint8_t>(name[j]);
  std::vector<uint8_t> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed + 167 * i + (i >> 9));
  return out;
}

inline uint64_t NumBytes(const TensorSpec& t) {
  uint64_t n = DTypeSize(*DTypeFromName(t.dtype));
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return n;
}

// The bytes of `box` of a row-major tensor whose bytes are `whole`.
inline std::vector<uint8_t> BoxBytes(const std::vector<uint8_t>& whole, const Shape& shape,
                                     size_t element, const Box& box) {
  std::vector<uint8_t> out;
  const int64_t count = box.NumElements();
  if (count == 0) return out;
  out.reserve(static_cast<size_t>(count) * element);
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  std::vector<int64_t> index(box.rank(), 0);
  for (int64_t n = 0; n < count; ++n) {
    int64_t at = 0;
    for (size_t d = 0; d < box.rank(); ++d) at += (box.offsets[d] + index[d]) * strides[d];
    out.insert(out.end(), whole.begin() + at * element, whole.begin() + (at + 1) * element);
    for (size_t d = box.rank(); d-- > 0;) {
      if (++index[d] < box.sizes[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

// Writes `files` (name -> tensor names in order) of `tensors` into `dir` with write_hf.py,
// and the index JSON when `index`. Returns the script's exit status and output.
inline std::pair<int, std::string> WriteHuggingFace(
    const std::string& dir,
    const std::vector<std::pair<std::string, std::vector<std::string>>>& files,
    const std::vector<TensorSpec>& tensors, bool index,
    const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::json spec;
  spec["dir"] = dir;
  spec["index"] = index;
  spec["files"] = nlohmann::json::object();
  for (const auto& [name, names] : files) spec["files"][name] = names;
  spec["tensors"] = nlohmann::json::object();
  for (const TensorSpec& t : tensors) {
    spec["tensors"][t.name] = {{"dtype", t.dtype}, {"shape", t.shape}};
  }
  if (!metadata.empty()) spec["metadata"] = metadata;
  const std::string script =
      std::string(TESSERA_SOURCE_DIR) + "/src/format/huggingface/testdata/write_hf.py";
  std::string output;
  const int status = torch_dist::testing::RunCommand(
      std::string(TESSERA_PYTHON) + " " + torch_dist::testing::ShellQuote(script) + " " +
          torch_dist::testing::ShellQuote(spec.dump()),
      &output);
  return {status, output};
}

// A safetensors file with the header text `header` (no padding added) followed by `data`.
inline void WriteRawSafetensors(const std::string& path, const std::string& header,
                                const std::vector<uint8_t>& data,
                                uint64_t declared_length = ~0ull) {
  const uint64_t n = declared_length == ~0ull ? header.size() : declared_length;
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

}  // namespace tessera::hf_testing

#endif  // TESSERA_CHECKPOINT_HF_TEST_UTIL_H_
