// Helpers shared by the torch_dist tests (test-only; not part of the library).
#ifndef TESSERA_FORMAT_TORCH_DIST_TEST_UTIL_H_
#define TESSERA_FORMAT_TORCH_DIST_TEST_UTIL_H_

#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace tessera::torch_dist::testing {

inline std::string TestdataDir() {
  return std::string(TESSERA_SOURCE_DIR) + "/src/format/torch_dist/testdata";
}

inline std::vector<uint8_t> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

inline void WriteFileBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

inline std::string Hex(const uint8_t* data, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kHex[data[i] >> 4]);
    out.push_back(kHex[data[i] & 15]);
  }
  return out;
}

inline std::vector<uint8_t> FromHex(const std::string& hex) {
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = std::stoi(hex.substr(2 * i, 2), nullptr, 16);
  return out;
}

// Runs `command` with stderr merged into `output`; returns its exit status (-1 if it died).
inline int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output->append(buf, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs testdata/<script> with /usr/bin/python3 (torch 1.13) and the given arguments.
inline int RunPython(const std::string& script, const std::vector<std::string>& args,
                     std::string* output) {
  std::string command =
      std::string(TESSERA_PYTHON) + " " + ShellQuote(TestdataDir() + "/" + script);
  for (const std::string& a : args) command += " " + ShellQuote(a);
  return RunCommand(command, output);
}

}  // namespace tessera::torch_dist::testing

#endif  // TESSERA_FORMAT_TORCH_DIST_TEST_UTIL_H_
