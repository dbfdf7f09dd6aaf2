#include "workload/model_state.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>

#include "plan/flat_range.h"
#include "tessera/sharded_tensor.h"

namespace tessera::workload {
namespace {

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t KeyHash(const std::string& key) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ULL;
  return h;
}

// [begin, begin + size) of part `i` of `n` split into `parts` as evenly as possible.
std::pair<int64_t, int64_t> Split(int64_t n, int64_t parts, int64_t i) {
  int64_t base = n / parts, rem = n % parts;
  return {i * base + std::min(i, rem), base + (i < rem ? 1 : 0)};
}

// Calls fn(global linear index of the row's first element, elements) for each innermost row
// of `box`, in row-major order.
void ForEachRow(const Box& box, const Shape& shape,
                const std::function<void(int64_t, int64_t)>& fn) {
  if (box.empty()) return;
  const size_t rank = box.rank();
  if (rank == 0) {
    fn(0, 1);
    return;
  }
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  std::vector<int64_t> at = box.offsets.ToVector();
  while (true) {
    int64_t start = 0;
    for (size_t d = 0; d < rank; ++d) start += at[d] * strides[d];
    fn(start, box.sizes[rank - 1]);
    size_t d = rank - 1;
    while (true) {
      if (d == 0) return;
      --d;
      if (++at[d] < box.end(d)) break;
      at[d] = box.offsets[d];
    }
  }
}

// The boxes `tensor.data` holds, in memory order, each with its byte offset into the data.
std::vector<std::pair<Box, int64_t>> MemoryBoxes(const ShardedTensor& tensor) {
  std::vector<std::pair<Box, int64_t>> out;
  const int64_t element_size = static_cast<int64_t>(DTypeSize(tensor.data.dtype));
  if (!tensor.flat_range) {
    out.emplace_back(tensor.LocalBox(), 0);
    return out;
  }
  for (FlatPiece& p :
       FlatRangeToBoxes(tensor.LocalBox(), tensor.flat_range->begin, tensor.flat_range->end)) {
    out.emplace_back(std::move(p.box), (p.flat_begin - tensor.flat_range->begin) * element_size);
  }
  return out;
}

// Visits every element of `tensor` with its pattern value: fn(byte pointer, pattern bits).
template <typename Fn>
bool VisitElements(const ShardedTensor& tensor, Fn&& fn) {
  const uint64_t key_hash = KeyHash(tensor.key);
  const size_t element_size = DTypeSize(tensor.data.dtype);
  bool ok = true;
  for (const auto& [box, byte_offset] : MemoryBoxes(tensor)) {
    std::byte* out = tensor.data.bytes() + byte_offset;
    ForEachRow(box, tensor.global_shape, [&](int64_t start, int64_t count) {
      for (int64_t i = 0; i < count && ok; ++i) {
        ok = fn(out, Mix(key_hash + static_cast<uint64_t>(start + i)));
        out += element_size;
      }
    });
    if (!ok) break;
  }
  return ok;
}

constexpr char kStepValue[] = "step=1000";  // the "optimizer.step" object

struct ParamSpec {
  std::string key;
  Shape shape;
  int split_dim;  // -1: replicated over TP
  int stage;      // pipeline stage that holds it
};

std::vector<ParamSpec> Params(const ModelConfig& c, int pp) {
  std::vector<ParamSpec> out;
  const int64_t h = c.hidden;
  out.push_back({"embedding.word_embeddings.weight", {c.vocab, h}, 0, 0});
  for (int64_t l = 0; l < c.layers; ++l) {
    int stage = static_cast<int>(l * pp / c.layers);
    std::string p = "decoder.layers." + std::to_string(l) + ".";
    out.push_back({p + "input_layernorm.weight", {h}, -1, stage});
    out.push_back({p + "self_attention.linear_qkv.weight", {3 * h, h}, 0, stage});
    out.push_back({p + "self_attention.linear_proj.weight", {h, h}, 1, stage});
    out.push_back({p + "mlp.linear_fc1.weight", {c.ffn, h}, 0, stage});
    out.push_back({p + "mlp.linear_fc2.weight", {h, c.ffn}, 1, stage});
  }
  out.push_back({"decoder.final_layernorm.weight", {h}, -1, pp - 1});
  return out;
}

}  // namespace

std::string Layout::ToString() const {
  std::string out = "tp" + std::to_string(tp);
  if (pp > 1) out += ",pp" + std::to_string(pp);
  return out + ",dp" + std::to_string(dp);
}

Result<Layout> ParseLayout(const std::string& text) {
  Layout layout;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    int* field = nullptr;
    if (part.rfind("tp", 0) == 0) field = &layout.tp;
    if (part.rfind("pp", 0) == 0) field = &layout.pp;
    if (part.rfind("dp", 0) == 0) field = &layout.dp;
    char* end = nullptr;
    long value = field ? std::strtol(part.c_str() + 2, &end, 10) : 0;
    if (!field || !end || *end != '\0' || value < 1 || value > 65536) {
      return InvalidArgument("bad layout '" + text + "': expected parts like tp2,pp1,dp4, got '" +
                             part + "'");
    }
    *field = static_cast<int>(value);
  }
  return layout;
}

ModelConfig ModelConfig::ForBytes(uint64_t bytes, int64_t layers) {
  // Per parameter: BF16 value + two F32 moments = 10 bytes; params ~ (12 L + 4) h^2 with
  // ffn = vocab = 4h.
  ModelConfig c;
  c.layers = layers;
  double h = std::sqrt(static_cast<double>(bytes) / 10.0 / (12.0 * layers + 4.0));
  c.hidden = std::max<int64_t>(8, static_cast<int64_t>(h));
  c.ffn = 4 * c.hidden;
  c.vocab = 4 * c.hidden;
  return c;
}

uint64_t ModelConfig::StateBytes() const {
  uint64_t params = 0;
  for (const ParamSpec& p : Params(*this, 1)) params += Box::Whole(p.shape).NumElements();
  return params * 10 + sizeof(kStepValue) - 1;
}

RankState BuildRankState(const ModelConfig& config, const Layout& layout, int rank, bool fill) {
  const int tp = rank % layout.tp;
  const int pp = (rank / layout.tp) % layout.pp;
  const int dp = rank / (layout.tp * layout.pp);
  RankState state;
  auto allocate = [&](size_t bytes) {
    state.buffers.push_back(std::make_unique<std::vector<uint8_t>>(bytes));
    state.bytes += bytes;
    return state.buffers.back()->data();
  };
  auto add = [&](ShardedTensor t) {
    if (fill) FillPattern(t);
    Status s = state.dict.Add(std::move(t));
    if (!s.ok()) std::abort();  // the specs above are consistent by construction
  };
  for (const ParamSpec& p : Params(config, layout.pp)) {
    if (p.stage != pp) continue;
    Box local = Box::Whole(p.shape);
    if (p.split_dim >= 0) {
      auto [begin, size] = Split(p.shape[p.split_dim], layout.tp, tp);
      local.offsets[p.split_dim] = begin;
      local.sizes[p.split_dim] = size;
    }
    ReplicaId param_replica = p.split_dim >= 0 ? ReplicaId{dp} : ReplicaId{tp, dp};
    TensorView param(allocate(local.NumElements() * 2), DType::kBF16, local.sizes);
    add(ShardedTensor::Shard(p.key, param, p.shape, local.offsets, param_replica));
    // Adam moments: this DP rank's contiguous share of the flattened TP shard.
    auto [flat_begin, flat_size] = Split(local.NumElements(), layout.dp, dp);
    ReplicaId moment_replica = p.split_dim >= 0 ? ReplicaId{} : ReplicaId{tp};
    for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
      TensorView data(allocate(flat_size * 4), DType::kF32, {flat_size});
      add(ShardedTensor::FlatShard("optimizer." + std::string(moment) + "." + p.key, data, p.shape,
                                   local.offsets, local.sizes, flat_begin, moment_replica));
    }
  }
  ShardedObject step{"optimizer.step", {}, {rank}};
  if (fill) step.data.assign(kStepValue, kStepValue + sizeof(kStepValue) - 1);
  if (!state.dict.Add(std::move(step)).ok()) std::abort();
  return state;
}

Status CheckRankState(const RankState& state) {
  for (const StateEntry& entry : state.dict.entries()) {
    if (const auto* object = std::get_if<ShardedObject>(&entry)) {
      if (std::string(object->data.begin(), object->data.end()) != kStepValue) {
        return DataLoss("object '" + object->key + "' does not hold the saved bytes");
      }
      continue;
    }
    TESSERA_RETURN_IF_ERROR(CheckPattern(std::get<ShardedTensor>(entry)));
  }
  return Status::Ok();
}

void FillPattern(const ShardedTensor& tensor) {
  const size_t size = DTypeSize(tensor.data.dtype);
  VisitElements(tensor, [size](std::byte* p, uint64_t bits) {
    std::memcpy(p, &bits, size);
    return true;
  });
}

Status CheckPattern(const ShardedTensor& tensor) {
  const size_t size = DTypeSize(tensor.data.dtype);
  int64_t index = 0;
  bool ok = VisitElements(tensor, [&](std::byte* p, uint64_t bits) {
    if (std::memcmp(p, &bits, size) != 0) return false;
    ++index;
    return true;
  });
  if (!ok) {
    return DataLoss("key '" + tensor.key + "': local element " + std::to_string(index) +
                    " of box " + tensor.LocalBox().ToString() + " differs from the saved value");
  }
  return Status::Ok();
}

}  // namespace tessera::workload
