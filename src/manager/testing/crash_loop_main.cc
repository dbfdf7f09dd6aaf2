// tessera_manager_crash_loop ROOT LAST_STEP [ELEMENTS]: resumes the loop of crash_loop.h from
// the latest checkpoint under ROOT (a path or a URI: s3:// takes the AWS variables), checking it
// bit for bit, then saves every step up to LAST_STEP; the state holds ELEMENTS U32 weights
// (default crash_loop::kElements). Exit status 0 when done; 3 when the restored checkpoint
// holds other bytes; 4 on an error.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "manager/testing/crash_loop.h"

int main(int argc, char** argv) {
  using namespace tessera;
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: %s ROOT LAST_STEP [ELEMENTS]\n", argv[0]);
    return 2;
  }
  const std::string root = argv[1];
  const int64_t last = std::strtoll(argv[2], nullptr, 10);
  const size_t elements = argc == 4 ? std::strtoull(argv[3], nullptr, 10) : crash_loop::kElements;
  CheckpointManager manager(root, crash_loop::Options());
  crash_loop::LoopState state(elements);
  StateDict dict = state.Dict();
  int64_t step = 0;
  Result<RestoreReport> restored = manager.Restore(dict);
  if (restored.ok()) {
    state.From(dict);
    step = restored->step;
    if (!state.Holds(step)) {
      std::fprintf(stderr, "step %lld restored other bytes\n", static_cast<long long>(step));
      return 3;
    }
  } else if (restored.status().code() != StatusCode::kNotFound) {
    std::fprintf(stderr, "restore: %s\n", restored.status().ToString().c_str());
    return 4;
  }
  std::printf("resumed at step %lld\n", static_cast<long long>(step));
  std::fflush(stdout);
  while (step < last) {
    ++step;
    state.Fill(step);  // one "training step"
    StateDict to_save = state.Dict();
    Result<ManagedSave> saved = manager.Save(step, to_save);
    if (!saved.ok()) {
      std::fprintf(stderr, "save of step %lld: %s\n", static_cast<long long>(step),
                   saved.status().ToString().c_str());
      return 4;
    }
  }
  Status closed = manager.Close();
  if (!closed.ok()) {
    std::fprintf(stderr, "close: %s\n", closed.ToString().c_str());
    return 4;
  }
  return 0;
}
