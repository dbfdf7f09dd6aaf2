// How much a checksum pass costs on top of a copy, by piece size: copy 256 MiB piece by piece
// (what the kernel does for a page-cache read or write), then copy again hashing each piece
// right after copying it (what tessera's load does). Prints one JSON object. The kernel's
// choice (SSE2, AVX2, AVX-512) is libxxhash's, made at run time, as in tessera.
//
//   build/tessera_bench_checksum
#include <xxh_x86dispatch.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

int main() {
  using Clock = std::chrono::steady_clock;
  const size_t n = size_t{256} << 20;
  std::vector<char> source(n, 3), target(n, 2);  // both touched before timing
  auto seconds = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  std::printf("{\n  \"bytes\": %zu,\n  \"pieces\": [\n", n);
  const size_t pieces[] = {n, size_t{8} << 20, size_t{1} << 20, size_t{512} << 10,
                           size_t{256} << 10};
  for (size_t p = 0; p < std::size(pieces); ++p) {
    const size_t piece = pieces[p];
    double copy = 1e9, copy_and_hash = 1e9;
    for (int round = 0; round < 3; ++round) {  // best of 3
      Clock::time_point start = Clock::now();
      for (size_t at = 0; at < n; at += piece) std::memcpy(&target[at], &source[at], piece);
      copy = std::min(copy, seconds(start));
      start = Clock::now();
      XXH3_state_t* state = XXH3_createState();
      XXH3_64bits_reset(state);
      for (size_t at = 0; at < n; at += piece) {
        std::memcpy(&target[at], &source[at], piece);
        XXH3_64bits_update_dispatch(state, &target[at], piece);
      }
      volatile XXH64_hash_t digest = XXH3_64bits_digest(state);
      (void)digest;
      XXH3_freeState(state);
      copy_and_hash = std::min(copy_and_hash, seconds(start));
    }
    std::printf(
        "    {\"piece_bytes\": %zu, \"copy_seconds\": %.4f, \"copy_and_hash_seconds\": %.4f, "
        "\"copy_and_hash_over_copy\": %.3f}%s\n",
        piece, copy, copy_and_hash, copy_and_hash / copy, p + 1 < std::size(pieces) ? "," : "");
  }
  std::printf("  ]\n}\n");
  return 0;
}
