// Chunks stored inside wrappers (ChunkEncoding::kTorchSaveItem: each chunk of a PyTorch DCP
// checkpoint is a whole torch.save zip archive) are resolved into raw byte ranges before
// anything reads them, by the format's codec, lazily: a load resolves only the chunks its
// request touches (reading each item's zip directory and data.pkl, never its elements), so it
// reads only the byte ranges it needs, as for a tessera checkpoint. Planning and reading never
// see a wrapped chunk.
#ifndef TESSERA_CHECKPOINT_WRAPPED_CHUNKS_H_
#define TESSERA_CHECKPOINT_WRAPPED_CHUNKS_H_

#include <optional>
#include <string>

#include "plan/load_plan.h"
#include "tessera/checkpoint.h"

namespace tessera {

// What resolving cost and gave.
struct ResolvedIndex {
  // `metadata` with the wrapped chunks this rank's plan touches made raw, holding the chunks
  // of the tensors the plan touches only; nullopt when `metadata` had no wrapped chunk (use it
  // as it is). Good for this plan's reads, not for planning another request.
  std::optional<Metadata> metadata;
  uint64_t bytes_read = 0;  // of the items' zip directories and data.pkl records
  uint64_t read_calls = 0;
};

// PlanRankReads (see plan/load_plan.h) against `metadata`, whose data files are under `root`.
// When some chunk is wrapped: plans once to learn which chunks the request touches, resolves
// those with `num_threads` threads into `resolved.metadata`, and plans again against it; the
// returned plan refers to resolved.metadata. Errors of resolution name the key, the file and
// the item's offset. Local: no communication.
Result<RankReadPlan> PlanRankReadsResolving(Storage& storage, const std::string& root,
                                            const Metadata& metadata, StateDict& state,
                                            const std::string& path, bool skip_missing,
                                            bool cast_dtypes, int num_threads,
                                            ResolvedIndex& resolved);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_WRAPPED_CHUNKS_H_
