// Saves a tensor as two shards and loads it back whole, through the installed library.
// Usage: consumer DIR
#include <tessera/checkpoint.h>
#include <tessera/local_comm.h>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  using namespace tessera;
  const std::string dir = argv[1];
  Status saved = FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    std::vector<float> half(8, 1.0f + comm.rank());
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "w", TensorView(half.data(), DType::kF32, {2, 4}), {4, 4}, {2 * comm.rank(), 0})));
    return Save(state, dir, comm).status();
  }));
  if (!saved.ok()) {
    std::fprintf(stderr, "save: %s\n", saved.ToString().c_str());
    return 1;
  }
  std::vector<float> whole(16, 0.0f);
  StateDict state;
  Status added =
      state.Add(ShardedTensor::Whole("w", TensorView(whole.data(), DType::kF32, {4, 4})));
  Result<LoadReport> loaded = added.ok() ? Load(state, dir) : Result<LoadReport>(added);
  if (!loaded.ok()) {
    std::fprintf(stderr, "load: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  for (int i = 0; i < 16; ++i) {
    if (whole[i] != (i < 8 ? 1.0f : 2.0f)) {
      std::fprintf(stderr, "element %d is %f\n", i, whole[i]);
      return 1;
    }
  }
  std::printf(
      "consumer: saved 2 shards and loaded the whole tensor through find_package(tessera)\n");
  return 0;
}
