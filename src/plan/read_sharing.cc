#include "plan/read_sharing.h"

#include <queue>

#include <algorithm>
#include <numeric>

#include "core/byte_io.h"

namespace tessera {
namespace {

constexpr size_t kEncodedRunKeyBytes = 4 + 8 + 8 + 8 + 1;

}  // namespace

Bytes EncodeRunKeys(std::span<const ReadRun> runs) {
  Bytes out;
  out.reserve(4 + runs.size() * kEncodedRunKeyBytes);
  ByteWriter w(&out);
  w.Put<uint32_t>(static_cast<uint32_t>(runs.size()));
  for (const ReadRun& run : runs) {
    w.Put<uint32_t>(run.file_index);
    w.Put<uint64_t>(run.file_offset);
    w.Put<uint64_t>(run.length);
    w.Put<uint64_t>(run.DestinationLength());
    w.Put<uint8_t>(run.cast ? static_cast<uint8_t>(run.cast->to) : 0);
  }
  return out;
}

Result<std::vector<RunKey>> DecodeRunKeys(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  uint32_t n = 0;
  TESSERA_RETURN_IF_ERROR(r.Get(&n));
  if (n > bytes.size() / kEncodedRunKeyBytes) {
    return DataLoss("run list: count " + std::to_string(n) + " too large");
  }
  std::vector<RunKey> keys(n);
  for (RunKey& k : keys) {
    TESSERA_RETURN_IF_ERROR(r.Get(&k.file_index));
    TESSERA_RETURN_IF_ERROR(r.Get(&k.file_offset));
    TESSERA_RETURN_IF_ERROR(r.Get(&k.length));
    TESSERA_RETURN_IF_ERROR(r.Get(&k.destination_length));
    TESSERA_RETURN_IF_ERROR(r.Get(&k.cast_to));
  }
  return keys;
}

ReadAssignment AssignReads(std::span<const std::vector<RunKey>> runs_by_rank) {
  ReadAssignment a;
  for (const auto& runs : runs_by_rank) a.unique.insert(a.unique.end(), runs.begin(), runs.end());
  std::sort(a.unique.begin(), a.unique.end());
  a.unique.erase(std::unique(a.unique.begin(), a.unique.end()), a.unique.end());
  a.holders.resize(a.unique.size());
  a.unique_of.resize(runs_by_rank.size());
  for (size_t r = 0; r < runs_by_rank.size(); ++r) {
    for (const RunKey& key : runs_by_rank[r]) {
      uint32_t u = static_cast<uint32_t>(std::lower_bound(a.unique.begin(), a.unique.end(), key) -
                                         a.unique.begin());
      a.unique_of[r].push_back(u);
      a.holders[u].push_back(static_cast<int32_t>(r));  // ranks visited in order: ascending
    }
  }
  std::vector<uint32_t> order(a.unique.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) {
    if (a.holders[x].size() != a.holders[y].size()) {
      return a.holders[x].size() < a.holders[y].size();
    }
    return a.unique[x].length > a.unique[y].length;
  });
  a.num_holders.resize(a.unique.size());
  for (size_t u = 0; u < a.unique.size(); ++u) {
    a.num_holders[u] = static_cast<uint32_t>(a.holders[u].size());
  }
  std::vector<uint64_t> load(runs_by_rank.size(), 0);
  a.reader.assign(a.unique.size(), -1);
  for (uint32_t u : order) {
    int32_t best = a.holders[u][0];
    for (int32_t h : a.holders[u]) {
      if (load[h] < load[best]) best = h;
    }
    a.reader[u] = best;
    load[best] += a.unique[u].length;
  }
  return a;
}

ReadAssignment AssignIdenticalReads(std::span<const RunKey> runs, int num_ranks) {
  ReadAssignment a;
  a.unique.assign(runs.begin(), runs.end());
  std::sort(a.unique.begin(), a.unique.end());
  a.unique.erase(std::unique(a.unique.begin(), a.unique.end()), a.unique.end());
  a.num_holders.assign(a.unique.size(), static_cast<uint32_t>(num_ranks));
  std::vector<uint32_t> order(a.unique.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t x, uint32_t y) { return a.unique[x].length > a.unique[y].length; });
  // Least loaded first: a heap of (bytes, rank).
  std::priority_queue<std::pair<uint64_t, int32_t>, std::vector<std::pair<uint64_t, int32_t>>,
                      std::greater<>>
      load;
  for (int32_t r = 0; r < num_ranks; ++r) load.push({0, r});
  a.reader.assign(a.unique.size(), -1);
  for (uint32_t u : order) {
    auto [bytes, rank] = load.top();
    load.pop();
    a.reader[u] = rank;
    load.push({bytes + a.unique[u].length, rank});
  }
  return a;
}

std::vector<std::vector<ExchangePiece>> ScheduleExchange(const ReadAssignment& assignment,
                                                         int num_ranks,
                                                         uint64_t bytes_per_rank_per_round) {
  const uint64_t cap = std::max<uint64_t>(bytes_per_rank_per_round, 1);
  // Each sender fills its own sequence of rounds: its pieces go to the first round where it
  // still has room, so senders proceed in parallel and the rounds are as few as the busiest
  // sender needs.
  std::vector<std::vector<ExchangePiece>> rounds;
  std::vector<size_t> next_round(num_ranks, 0);
  std::vector<uint64_t> used_in_next(num_ranks, 0);
  for (uint32_t u = 0; u < assignment.unique.size(); ++u) {
    if (assignment.num_holders[u] < 2) continue;
    const int32_t sender = assignment.reader[u];
    const uint64_t length = assignment.unique[u].destination_length;
    for (uint64_t begin = 0; begin < length;) {
      if (used_in_next[sender] == cap) {
        ++next_round[sender];
        used_in_next[sender] = 0;
      }
      const uint64_t n = std::min(cap - used_in_next[sender], length - begin);
      if (rounds.size() <= next_round[sender]) rounds.resize(next_round[sender] + 1);
      rounds[next_round[sender]].push_back({u, begin, n});
      used_in_next[sender] += n;
      begin += n;
    }
  }
  return rounds;
}

}  // namespace tessera
