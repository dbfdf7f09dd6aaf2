// A synthetic transformer-like training state, sharded the way Megatron-style training shards
// it, for the demo and the benchmarks:
//
//   embedding [vocab, hidden]          split along dim 0 over TP, first pipeline stage
//   per layer: qkv [3h, h] (dim 0), proj [h, h] (dim 1), fc1 [ffn, h] (dim 0),
//              fc2 [h, ffn] (dim 1), input norm [h] (replicated over TP)
//   final norm [h]                     replicated over TP, last pipeline stage
//   Adam moments of every parameter    F32, flat ranges of the TP shard over DP
//   "optimizer.step"                   an object held by every rank
//
// Parameters are BF16 and replicated over DP (replica id {dp}, or {tp, dp} for norms).
// Every element's bits are a hash of (key, global index), so a loaded state is checked
// without keeping the saved one.
#ifndef TESSERA_WORKLOAD_MODEL_STATE_H_
#define TESSERA_WORKLOAD_MODEL_STATE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/state_dict.h"
#include "tessera/status.h"

namespace tessera::workload {

struct Layout {
  int tp = 1, pp = 1, dp = 1;
  int ranks() const { return tp * pp * dp; }
  std::string ToString() const;
};

// "tp2,dp4", "tp2,pp2,dp2" (any order; missing factors are 1).
Result<Layout> ParseLayout(const std::string& text);

struct ModelConfig {
  int64_t hidden = 1024;
  int64_t ffn = 4096;
  int64_t vocab = 8192;
  int64_t layers = 4;

  // A config whose full state (params + Adam moments) is about `bytes`.
  static ModelConfig ForBytes(uint64_t bytes, int64_t layers = 4);
  // Bytes of the whole state (tensors and the step object), each unique element counted once.
  uint64_t StateBytes() const;
};

// One rank's share of the state, owning its buffers.
struct RankState {
  StateDict dict;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> buffers;
  uint64_t bytes = 0;  // of the tensors this rank holds
};

// The state rank `rank` of `layout` holds. With `fill`, the tensors hold their pattern
// values; without, zeros (a load destination).
RankState BuildRankState(const ModelConfig& config, const Layout& layout, int rank, bool fill);

// Checks every tensor and object of `state` against the pattern; the error names the key and
// the first differing element.
Status CheckRankState(const RankState& state);

// The pattern itself, for any tensor: element bits are a hash of (key, global linear index).
// Fills tensor.data (through its flat range, if any).
void FillPattern(const ShardedTensor& tensor);
// The error names the key and the first differing local element.
Status CheckPattern(const ShardedTensor& tensor);

}  // namespace tessera::workload

#endif  // TESSERA_WORKLOAD_MODEL_STATE_H_
