// The managed training loop that CheckpointManagerKillTest kills with SIGKILL at random moments
// (crash_loop_main.cc is the program; the test checks the root after each kill). Its state at
// step s is a pure function of s, so any checkpoint can be checked bit for bit.
#ifndef TESSERA_MANAGER_TESTING_CRASH_LOOP_H_
#define TESSERA_MANAGER_TESTING_CRASH_LOOP_H_

#include <cstdint>
#include <vector>

#include "tessera/checkpoint_manager.h"

namespace tessera::crash_loop {

// 1 MiB of U32 "weights" (by default) and an object naming the step.
inline constexpr size_t kElements = 256 * 1024;

inline uint32_t Value(int64_t step, size_t i) {
  uint64_t x = static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 31;
  return static_cast<uint32_t>(x * 0xBF58476D1CE4E5B9ull >> 32);
}

struct LoopState {
  explicit LoopState(size_t elements = kElements) : weights(elements) {}
  std::vector<uint32_t> weights;
  std::vector<uint8_t> note;

  void Fill(int64_t step) {
    for (size_t i = 0; i < weights.size(); ++i) weights[i] = Value(step, i);
    note.assign(8, 0);
    for (int b = 0; b < 8; ++b) note[b] = static_cast<uint8_t>(step >> (8 * b));
  }
  bool Holds(int64_t step) const {
    LoopState want(weights.size());
    want.Fill(step);
    return weights == want.weights && note == want.note;
  }
  StateDict Dict() {
    StateDict s;
    (void)s.Add(ShardedTensor::Whole(
        "weights",
        TensorView(weights.data(), DType::kU32, {static_cast<int64_t>(weights.size())})));
    (void)s.Add(ShardedObject{.key = "note", .data = note});
    return s;
  }
  void From(const StateDict& dict) { note = std::get<ShardedObject>(*dict.Find("note")).data; }
};

// The loop's manager: save every step, keep 2, asynchronous, durable.
inline CheckpointManagerOptions Options() {
  CheckpointManagerOptions o;
  o.retention.keep_last = 2;
  return o;
}

}  // namespace tessera::crash_loop

#endif  // TESSERA_MANAGER_TESTING_CRASH_LOOP_H_
