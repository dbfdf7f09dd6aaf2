// kill -9 at random moments of a managed training loop (save every step, keep 2): after every
// kill, LatestStep() names a checkpoint that restores bit for bit, the retention has left at
// least that newest whole checkpoint, and no committed progress is ever lost.
#include <gtest/gtest.h>

#include <cstdlib>

#include "manager/testing/kill_trials.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

TEST(CheckpointManagerKillTest, LatestLoadsAfterEveryKill) {
  testing::TempDir dir;
  kill_trials::Trials t;
  t.root = dir.Sub("run");
  t.log = dir.Sub("loop.log");
  // TESSERA_KILL_SEED and TESSERA_KILL_TRIALS repeat a run or make it longer.
  if (const char* seed = std::getenv("TESSERA_KILL_SEED"))
    t.seed = std::strtoull(seed, nullptr, 10);
  if (const char* trials = std::getenv("TESSERA_KILL_TRIALS")) t.trials = std::atoi(trials);
  // Up to 400 ms: the process start, the restore, and a few saves, each killable anywhere.
  kill_trials::Run(t);
}

}  // namespace
}  // namespace tessera
