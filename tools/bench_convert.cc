// tessera bench convert: the two Hugging Face figures of issue 13, each against a raw baseline
// of the same bytes measured in the same run (docs/PERFORMANCE.md):
//
//   export: `tessera convert --to safetensors` of a sharded tessera checkpoint (saved by
//     `--layout`, default tp2,dp2) against `cp` of its data files;
//   load: the exported files loaded resharded over 2 ranks (each rank half the rows of every
//     tensor) against a raw pread, by the same number of threads, of the bytes those ranks need.
//
// Both from the page cache, without syncs (the checkpoint was just written); syncfs() before
// every phase, outside the timing, so no phase pays for the writeback of another's files. Each
// figure is the best of --repeat samples after --warmup untimed ones; the medians are reported
// too.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/local_comm.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "workload/model_state.h"

namespace tessera::tools {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct BenchConvertOptions {
  uint64_t size_bytes = 1ull << 30;
  std::string layout = "tp2,dp2";
  int threads = ConvertOptions().num_threads;
  int io_threads = LoadOptions().num_io_threads;  // per rank, for the load and its baseline
  int repeat = 3;
  int warmup = 1;
  std::string dir;
};

constexpr int kLoadRanks = 2;

// One contiguous byte range a rank needs, and where it goes.
struct Range {
  std::string path;
  uint64_t offset = 0, length = 0;
  std::byte* destination = nullptr;
};

// Each rank's share of the exported checkpoint: rows [n r / 2, n (r+1) / 2) of every tensor
// (rank 0 takes the scalars), with buffers, and the contiguous ranges of file bytes it needs.
struct LoadShare {
  StateDict state;
  std::vector<std::unique_ptr<std::vector<std::byte>>> buffers;
  std::vector<Range> ranges;
  uint64_t bytes = 0;
};

LoadShare ShareOf(const std::string& root, const Metadata& m, int rank) {
  LoadShare share;
  for (const TensorInfo& t : m.tensors) {
    Box box = Box::Whole(t.global_shape);
    if (box.rank() == 0 && rank != 0) continue;
    uint64_t first_row = 0, row_bytes = 0;
    if (box.rank() > 0) {
      const int64_t rows = t.global_shape[0];
      box.offsets[0] = rows * rank / kLoadRanks;
      box.sizes[0] = rows * (rank + 1) / kLoadRanks - box.offsets[0];
      first_row = static_cast<uint64_t>(box.offsets[0]);
      row_bytes = rows == 0
                      ? 0
                      : static_cast<uint64_t>(Box::Whole(t.global_shape).NumElements() / rows) *
                            DTypeSize(t.dtype);
    }
    const uint64_t bytes = static_cast<uint64_t>(box.NumElements()) * DTypeSize(t.dtype);
    share.buffers.push_back(std::make_unique<std::vector<std::byte>>(bytes));
    std::byte* data = share.buffers.back()->data();
    share.state
        .Add(ShardedTensor::Shard(t.key, TensorView(data, t.dtype, box.sizes), t.global_shape,
                                  box.offsets))
        .IgnoreError();  // keys and boxes of a checkpoint that was just read
    // Hugging Face tensors are one chunk each: a slice of rows is one contiguous range.
    const ByteLocation& at = t.chunks[0].location;
    share.ranges.push_back(Range{JoinPath(root, m.files[at.file_index].name),
                                 at.offset + first_row * row_bytes, bytes, data});
    share.bytes += bytes;
  }
  return share;
}

// The baseline: `threads` threads pread the ranges (split by bytes, in order), 8 MiB at a time.
Status RawRead(Storage& storage, const std::vector<Range>& ranges, int threads) {
  uint64_t total = 0;
  for (const Range& r : ranges) total += r.length;
  std::vector<size_t> bounds = {0};
  uint64_t acc = 0;
  for (size_t i = 0; i < ranges.size() && bounds.size() < static_cast<size_t>(threads); ++i) {
    acc += ranges[i].length;
    if (acc * threads >= total * bounds.size()) bounds.push_back(i + 1);
  }
  bounds.push_back(ranges.size());
  std::vector<Status> statuses(bounds.size() - 1);
  auto work = [&](size_t slice) {
    std::string open_path;
    std::unique_ptr<ReadableFile> file;
    for (size_t i = bounds[slice]; i < bounds[slice + 1]; ++i) {
      const Range& r = ranges[i];
      if (r.path != open_path) {
        Result<std::unique_ptr<ReadableFile>> opened = storage.NewReadableFile(r.path);
        if (!opened.ok()) {
          statuses[slice] = opened.status();
          return;
        }
        file = std::move(*opened);
        open_path = r.path;
      }
      for (uint64_t done = 0; done < r.length;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(8u << 20, r.length - done));
        if (Status s = file->ReadAt(r.offset + done, r.destination + done, n); !s.ok()) {
          statuses[slice] = s;
          return;
        }
        done += n;
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t s = 1; s < statuses.size(); ++s) pool.emplace_back(work, s);
  if (!statuses.empty()) work(0);
  for (std::thread& t : pool) t.join();
  for (const Status& s : statuses) TESSERA_RETURN_IF_ERROR(s);
  return Status::Ok();
}

Status SaveSource(const BenchConvertOptions& o, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(workload::Layout layout, workload::ParseLayout(o.layout));
  const workload::ModelConfig config = workload::ModelConfig::ForBytes(o.size_bytes);
  SaveOptions save;
  save.sync = SyncPolicy::kNone;
  return FirstError(RunLocalRanks(layout.ranks(), [&](Comm& comm) -> Status {
    workload::RankState state = workload::BuildRankState(config, layout, comm.rank(), true);
    return Save(state.dict, path, comm, save).status();
  }));
}

// Writes back what earlier phases left dirty (outside the timing).
void Flush(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::syncfs(fd);
  ::close(fd);
}

double Best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Result<nlohmann::json> Run(const BenchConvertOptions& o, const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string src = dir + "/src", copy = dir + "/cp", hf = dir + "/hf";
  TESSERA_RETURN_IF_ERROR(SaveSource(o, src));
  std::string files;
  uint64_t data_bytes = 0;
  for (const auto& e : fs::directory_iterator(src)) {
    if (e.path().extension() != ".safetensors") continue;
    files += " '" + e.path().string() + "'";
    data_bytes += fs::file_size(e.path());
  }
  std::shared_ptr<Storage> storage = NewPosixStorage();
  std::vector<double> cp_s, convert_s, load_s, raw_s;
  uint64_t exported = 0, needed = 0, read = 0;
  for (int sample = 0; sample < o.warmup + o.repeat; ++sample) {
    const bool timed = sample >= o.warmup;
    std::error_code ec;
    fs::remove_all(copy, ec);
    fs::remove_all(hf, ec);
    fs::create_directories(copy);
    Flush(dir);
    // The raw copy: cp itself, never cloning (a reflink would copy no bytes).
    Clock::time_point start = Clock::now();
    if (std::system(("cp --reflink=never" + files + " '" + copy + "/'").c_str()) != 0) {
      return IOError("cp of the data files of " + src + " failed");
    }
    if (timed) cp_s.push_back(Since(start));
    ConvertOptions convert;
    convert.sync = SyncPolicy::kNone;
    convert.num_threads = o.threads;
    Flush(dir);
    start = Clock::now();
    TESSERA_ASSIGN_OR_RETURN(ConvertReport report, Convert(src, hf, convert));
    if (timed) convert_s.push_back(Since(start));
    exported = report.bytes_written;

    // The exported files, loaded by 2 ranks, and the same bytes read raw.
    TESSERA_ASSIGN_OR_RETURN(Metadata m, ReadMetadata(hf));
    std::vector<LoadShare> shares;
    for (int r = 0; r < kLoadRanks; ++r) shares.push_back(ShareOf(hf, m, r));
    std::vector<double> seconds(kLoadRanks);
    std::vector<LoadReport> reports(kLoadRanks);
    LoadOptions load;
    load.num_io_threads = o.io_threads;
    Flush(dir);
    TESSERA_RETURN_IF_ERROR(FirstError(RunLocalRanks(kLoadRanks, [&](Comm& comm) -> Status {
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      const Clock::time_point begin = Clock::now();
      TESSERA_ASSIGN_OR_RETURN(reports[comm.rank()],
                               Load(shares[comm.rank()].state, hf, comm, load));
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      seconds[comm.rank()] = Since(begin);
      return Status::Ok();
    })));
    if (timed) load_s.push_back(*std::max_element(seconds.begin(), seconds.end()));
    needed = read = 0;
    for (const LoadReport& r : reports) needed += r.bytes_needed, read += r.bytes_read;
    std::vector<Status> raw(kLoadRanks);
    start = Clock::now();
    std::vector<std::thread> ranks;
    for (int r = 0; r < kLoadRanks; ++r) {
      ranks.emplace_back([&, r] { raw[r] = RawRead(*storage, shares[r].ranges, o.io_threads); });
    }
    for (std::thread& t : ranks) t.join();
    if (timed) raw_s.push_back(Since(start));
    for (const Status& s : raw) TESSERA_RETURN_IF_ERROR(s);
  }
  nlohmann::json out;
  out["benchmark"] = "convert";
  out["source_layout"] = o.layout;
  out["data_file_bytes"] = data_bytes;
  out["exported_bytes"] = exported;
  out["threads"] = o.threads;
  out["repeat"] = o.repeat;
  out["cp_seconds"] = Best(cp_s);
  out["convert_seconds"] = Best(convert_s);
  out["export_over_cp"] = Best(cp_s) / Best(convert_s);  // goal >= 0.8
  out["median_export_over_cp"] = Median(cp_s) / Median(convert_s);
  out["load_ranks"] = kLoadRanks;
  out["load_bytes_needed"] = needed;
  out["load_bytes_read"] = read;
  out["load_seconds"] = Best(load_s);
  out["raw_read_seconds"] = Best(raw_s);
  out["load_over_raw"] = Best(raw_s) / Best(load_s);  // goal >= 0.8
  out["median_load_over_raw"] = Median(raw_s) / Median(load_s);
  return out;
}

}  // namespace

void AddBenchConvertCommand(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<BenchConvertOptions>();
  auto size_text = std::make_shared<std::string>("1GiB");
  auto json = std::make_shared<bool>(true);
  CLI::App* cmd = bench.add_subcommand(
      "convert",
      "Export a sharded checkpoint to safetensors against cp of its data files, and load the "
      "export resharded over 2 ranks against a raw read of the bytes needed; JSON");
  cmd->add_option("--size", *size_text, "state size, e.g. 256MiB, 1GiB")->capture_default_str();
  cmd->add_option("--layout", o->layout, "layout that saves the source")->capture_default_str();
  cmd->add_option("--threads", o->threads, "convert threads")->capture_default_str();
  cmd->add_option("--io-threads", o->io_threads, "I/O threads per loading rank (and baseline)")
      ->capture_default_str();
  cmd->add_option("--repeat", o->repeat, "timed samples; the best is reported")
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed samples first")->capture_default_str();
  cmd->add_option("--dir", o->dir, "where the files go (default: a fresh temporary directory)");
  cmd->add_flag("--json", *json, "print JSON (the only output format)");
  cmd->callback([=] {
    (void)json;  // CLI11 writes it at parse time: the callback owns it
    Result<uint64_t> size = ParseSize(*size_text);
    if (!size.ok()) {
      *exit_code = Fail(size.status());
      return;
    }
    o->size_bytes = *size;
    if (o->repeat < 1 || o->warmup < 0 || o->threads < 1 || o->io_threads < 1) {
      *exit_code =
          Fail(InvalidArgument("--repeat, --threads and --io-threads must be >= 1, "
                               "--warmup >= 0"));
      return;
    }
    if (Status fits = CheckFitsInMemory(2 * o->size_bytes, "bench convert --size"); !fits.ok()) {
      *exit_code = Fail(fits);
      return;
    }
    Result<std::string> dir = MakeBenchDir(o->dir);
    if (!dir.ok()) {
      *exit_code = Fail(dir.status());
      return;
    }
    Result<nlohmann::json> out = Run(*o, *dir);
    RemoveBenchDir(*dir, o->dir);
    if (!out.ok()) {
      *exit_code = Fail(out.status());
      return;
    }
    PrintJson(std::move(*out));
    *exit_code = 0;
  });
}

}  // namespace tessera::tools
