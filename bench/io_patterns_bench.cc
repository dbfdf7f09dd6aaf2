// The I/O patterns behind tessera's write and read loops, measured side by side: the figures of
// docs/PERFORMANCE.md ("Surprises", "What was tried") and of the comments in save.cc and
// reader.cc. 4 threads, each with its own file of --mib-per-thread MiB (default 256: 1 GiB in
// all), every variant run --rounds times in turn (default 6); the median of each is printed as
// one JSON object. The last section runs tessera itself (Verify and a partial-chunk load, with
// and without mapped reads).
//
//   build/tessera_bench_io_patterns [--dir /tmp] [--mib-per-thread 256] [--rounds 6] [--cold]
//
// --cold (root) adds cold-cache reads: the page cache is dropped before each.
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxh_x86dispatch.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tessera/checkpoint.h"
#include "tessera/storage.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kThreads = 4;
constexpr size_t kPiece = 256u << 10;    // tessera's checksummed piece
constexpr size_t kRawPiece = 64u << 20;  // the raw baseline's pwrite/pread
constexpr size_t kStreamed = 8u << 20;   // tessera's writeback step
constexpr size_t kMapWindow = 4u << 20;  // tessera's mapped window

struct Options {
  std::string dir = "/tmp";
  size_t bytes_per_thread = size_t{256} << 20;
  int rounds = 6;
  bool cold = false;
};

// A hash state per thread; the digest is consumed so the compiler keeps the work.
struct Hasher {
  XXH3_state_t* state = XXH3_createState();
  Hasher() { XXH3_64bits_reset(state); }
  ~Hasher() {
    volatile XXH64_hash_t digest = XXH3_64bits_digest(state);
    (void)digest;
    XXH3_freeState(state);
  }
  void Update(const void* p, size_t n) { XXH3_64bits_update_dispatch(state, p, n); }
};

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// A benchmark of tessera that failed measures nothing: stop, saying why.
void CheckOk(const tessera::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "io_patterns_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

int OpenOrDie(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd >= 0) return fd;
  std::fprintf(stderr, "io_patterns_bench: open %s: %s\n", path.c_str(), std::strerror(errno));
  std::exit(1);
}

void DropPageCache() {
  sync();
  std::ofstream("/proc/sys/vm/drop_caches") << "1";
}

class Bench {
 public:
  explicit Bench(const Options& o) : o_(o), memory_(kThreads) {
    for (auto& m : memory_) {
      m = static_cast<char*>(std::aligned_alloc(4096, o.bytes_per_thread));  // O_DIRECT needs it
      for (size_t i = 0; i < o.bytes_per_thread; ++i) m[i] = static_cast<char>(i * 131);
    }
    dir_ = o.dir + "/tessera-io-patterns-" + std::to_string(getpid());
    std::filesystem::create_directories(dir_);
  }
  ~Bench() {
    std::filesystem::remove_all(dir_);
    for (char* m : memory_) std::free(m);
  }

  // Writes a fresh file per thread with `body(fd, memory)`, timed; then removes the files.
  double TimeWrite(int flags, const std::function<void(int, char*)>& body) {
    sync();
    std::vector<int> fds;
    for (int t = 0; t < kThreads; ++t) {
      fds.push_back(OpenOrDie(Path("w", t), O_CREAT | O_TRUNC | O_WRONLY | flags));
    }
    const double s = TimeThreads([&](int t) { body(fds[t], memory_[t]); });
    for (int t = 0; t < kThreads; ++t) {
      ::close(fds[t]);
      ::unlink(Path("w", t).c_str());
    }
    return s;
  }

  // Reads the per-thread files written by PrepareReadFiles with `body(fd, memory)`, timed.
  double TimeRead(bool cold, const std::function<void(int, char*)>& body) {
    if (cold) DropPageCache();
    std::vector<int> fds;
    for (int t = 0; t < kThreads; ++t) fds.push_back(OpenOrDie(Path("r", t), O_RDONLY));
    const double s = TimeThreads([&](int t) { body(fds[t], memory_[t]); });
    for (int fd : fds) ::close(fd);
    return s;
  }

  void PrepareReadFiles() {
    for (int t = 0; t < kThreads; ++t) {
      const int fd = OpenOrDie(Path("r", t), O_CREAT | O_TRUNC | O_WRONLY);
      (void)!::pwrite(fd, memory_[t], o_.bytes_per_thread, 0);
      ::close(fd);
    }
    sync();
  }

  size_t n() const { return o_.bytes_per_thread; }
  const std::string& dir() const { return dir_; }

 private:
  std::string Path(const char* kind, int t) const { return dir_ + "/" + kind + std::to_string(t); }
  double TimeThreads(const std::function<void(int)>& fn) {
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) threads.emplace_back(fn, t);
    for (std::thread& th : threads) th.join();
    return Seconds(start);
  }

  Options o_;
  std::vector<char*> memory_;
  std::string dir_;
};

// Runs every variant once untimed (a process's first writes land on memory the VM has not
// touched yet and run 2-4x slower), then `rounds` times in turn; returns the medians.
std::map<std::string, double> RunAll(
    int rounds, const std::vector<std::pair<std::string, std::function<double()>>>& variants) {
  for (const auto& [name, run] : variants) run();
  std::map<std::string, std::vector<double>> samples;
  for (int r = 0; r < rounds; ++r) {
    for (const auto& [name, run] : variants) samples[name].push_back(run());
  }
  std::map<std::string, double> medians;
  for (auto& [name, s] : samples) medians[name] = Median(s);
  return medians;
}

void Print(const char* section, const std::map<std::string, double>& medians, bool last) {
  std::printf("  \"%s\": {", section);
  const char* sep = "";
  for (const auto& [name, s] : medians) {
    std::printf("%s\n    \"%s\": %.4f", sep, name.c_str(), s);
    sep = ",";
  }
  std::printf("\n  }%s\n", last ? "" : ",");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc) {
      o.dir = argv[++i];
    } else if (a == "--mib-per-thread" && i + 1 < argc) {
      o.bytes_per_thread = std::strtoull(argv[++i], nullptr, 10) << 20;
    } else if (a == "--rounds" && i + 1 < argc) {
      o.rounds = std::atoi(argv[++i]);
    } else if (a == "--cold") {
      o.cold = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--dir DIR] [--mib-per-thread N] [--rounds N] [--cold]\n"
                   "unknown or incomplete argument: %s\n",
                   argv[0], a.c_str());
      return 2;
    }
  }
  if (o.bytes_per_thread < kRawPiece || o.bytes_per_thread % kRawPiece != 0 || o.rounds < 1) {
    std::fprintf(stderr, "--mib-per-thread must be a multiple of 64, --rounds at least 1\n");
    return 2;
  }
  Bench b(o);
  const size_t n = b.n();
  // Writes `piece` bytes at a time; hashes each piece before or after writing it, or not.
  enum class HashAt { kNone, kBefore, kAfter };
  auto pieces = [n](int fd, char* m, size_t piece, HashAt hash) {
    Hasher h;
    for (size_t at = 0; at < n; at += piece) {
      if (hash == HashAt::kBefore) h.Update(m + at, piece);
      (void)!::pwrite(fd, m + at, piece, static_cast<off_t>(at));
      if (hash == HashAt::kAfter) h.Update(m + at, piece);
    }
  };
  // Synced: `piece` at a time, sync_file_range after each when `streamed`, waiting for the
  // range before the previous one too when `wait_before`; then fdatasync.
  auto synced = [n](int fd, char* m, size_t piece, bool streamed, bool wait_before) {
    for (size_t at = 0; at < n; at += piece) {
      (void)!::pwrite(fd, m + at, piece, static_cast<off_t>(at));
      if (streamed) ::sync_file_range(fd, at, piece, SYNC_FILE_RANGE_WRITE);
      if (wait_before && at >= piece) {
        ::sync_file_range(
            fd, at - piece, piece,
            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      }
    }
    ::fdatasync(fd);
  };
  std::printf("{\n  \"threads\": %d,\n  \"bytes\": %zu,\n  \"rounds\": %d,\n", kThreads,
              kThreads * n, o.rounds);
  // One timed variant: every thread writes its file with `pieces` or `synced`.
  auto piecewise = [&](size_t piece, HashAt hash) {
    return [&, piece, hash] {
      return b.TimeWrite(0, [&](int fd, char* m) { pieces(fd, m, piece, hash); });
    };
  };
  auto durable = [&](int flags, size_t piece, bool streamed, bool wait_before) {
    return [&, flags, piece, streamed, wait_before] {
      return b.TimeWrite(flags,
                         [&](int fd, char* m) { synced(fd, m, piece, streamed, wait_before); });
    };
  };
  Print("page_cache_write_seconds",
        RunAll(o.rounds, {{"plain_64MiB_pwrites", piecewise(kRawPiece, HashAt::kNone)},
                          {"256KiB_pwrites", piecewise(kPiece, HashAt::kNone)},
                          {"256KiB_hash_before_write", piecewise(kPiece, HashAt::kBefore)},
                          {"256KiB_hash_after_write", piecewise(kPiece, HashAt::kAfter)},
                          {"2MiB_hash_after_write", piecewise(2u << 20, HashAt::kAfter)}}),
        false);
  Print("synced_write_seconds",
        RunAll(o.rounds, {{"plain_64MiB_then_fdatasync", durable(0, kRawPiece, false, false)},
                          {"8MiB_sync_file_range_each", durable(0, kStreamed, true, false)},
                          {"8MiB_sync_file_range_wait_before", durable(0, kStreamed, true, true)},
                          {"8MiB_o_direct", durable(O_DIRECT, kStreamed, false, false)}}),
        false);

  b.PrepareReadFiles();
  auto read_plain = [n](int fd, char* m) {
    for (size_t at = 0; at < n; at += kRawPiece) (void)!::pread(fd, m + at, kRawPiece, at);
  };
  auto read_hashed = [n](int fd, char* m) {
    Hasher h;
    for (size_t at = 0; at < n; at += kPiece) {
      (void)!::pread(fd, m + at, kPiece, static_cast<off_t>(at));
      h.Update(m + at, kPiece);
    }
  };
  auto read_mapped = [n](int fd, char* m) {
    Hasher h;
    for (size_t w = 0; w < n; w += kMapWindow) {
      void* map = ::mmap(nullptr, kMapWindow, PROT_READ, MAP_SHARED | MAP_POPULATE, fd,
                         static_cast<off_t>(w));
      for (size_t at = 0; at < kMapWindow; at += kPiece) {
        std::memcpy(m + w + at, static_cast<char*>(map) + at, kPiece);
        h.Update(m + w + at, kPiece);
      }
      ::munmap(map, kMapWindow);
    }
  };
  auto read_bounced = [n](int fd, char* m) {
    Hasher h;
    std::vector<char> bounce(kPiece);
    for (size_t at = 0; at < n; at += kPiece) {
      (void)!::pread(fd, bounce.data(), kPiece, static_cast<off_t>(at));
      h.Update(bounce.data(), kPiece);
      std::memcpy(m + at, bounce.data(), kPiece);
    }
  };
  auto read_willneed = [n](int fd, char* m) {
    Hasher h;
    for (size_t at = 0; at < n; at += kPiece) {
      if (at % kStreamed == 0) ::posix_fadvise(fd, at, kStreamed, POSIX_FADV_WILLNEED);
      (void)!::pread(fd, m + at, kPiece, static_cast<off_t>(at));
      h.Update(m + at, kPiece);
    }
  };
  Print("page_cache_read_seconds",
        RunAll(o.rounds,
               {{"plain_64MiB_preads", [&] { return b.TimeRead(false, read_plain); }},
                {"256KiB_pread_then_hash", [&] { return b.TimeRead(false, read_hashed); }},
                {"4MiB_mapped_copy_then_hash", [&] { return b.TimeRead(false, read_mapped); }},
                {"256KiB_bounce_hash_copy", [&] { return b.TimeRead(false, read_bounced); }}}),
        false);
  if (o.cold) {
    Print("cold_read_seconds",
          RunAll(std::min(o.rounds, 3),
                 {{"plain_64MiB_preads", [&] { return b.TimeRead(true, read_plain); }},
                  {"256KiB_pread_then_hash", [&] { return b.TimeRead(true, read_hashed); }},
                  {"256KiB_pread_then_hash_willneed",
                   [&] { return b.TimeRead(true, read_willneed); }}}),
          false);
  }

  // One thread: where the hash's time goes after a pread. Seconds for the whole file.
  {
    std::vector<char> dst(n), hot(kPiece, 1);
    double pread_s = 0, hash_after_s = 0, hash_hot_s = 0;
    const int fd = OpenOrDie(b.dir() + "/r0", O_RDONLY);
    for (size_t at = 0; at < n; at += kPiece) {
      const Clock::time_point a = Clock::now();
      (void)!::pread(fd, dst.data() + at, kPiece, static_cast<off_t>(at));
      const Clock::time_point c = Clock::now();
      volatile XXH64_hash_t h1 = XXH3_64bits_dispatch(dst.data() + at, kPiece);
      const Clock::time_point d = Clock::now();
      volatile XXH64_hash_t h2 = XXH3_64bits_dispatch(hot.data(), kPiece);
      (void)h1;
      (void)h2;
      pread_s += std::chrono::duration<double>(c - a).count();
      hash_after_s += std::chrono::duration<double>(d - c).count();
      hash_hot_s += Seconds(d);
    }
    ::close(fd);
    Print("one_thread_read_seconds",
          {{"256KiB_preads", pread_s},
           {"hash_right_after_each_pread", hash_after_s},
           {"hash_of_cache_hot_bytes", hash_hot_s}},
          false);
  }

  // tessera itself: Verify and a partial-chunk checked load, mapped or through pread.
  {
    using namespace tessera;
    std::vector<std::vector<uint8_t>> data;
    StateDict state;
    const int64_t per_tensor = 64 << 20;
    for (size_t i = 0; i < kThreads * n / per_tensor; ++i) {
      data.emplace_back(per_tensor, static_cast<uint8_t>(i));
      CheckOk(
          state.Add(ShardedTensor::Whole("t" + std::to_string(i),
                                         TensorView(data.back().data(), DType::kU8, {per_tensor}))),
          "state");
    }
    const std::string ckpt = b.dir() + "/ckpt";
    SaveOptions save_options;
    save_options.sync = SyncPolicy::kNone;
    CheckOk(Save(state, ckpt, save_options).status(), "save");
    auto storage = [](bool map) { return NewPosixStorage({.map_reads = map}); };
    auto verify = [&](bool map) {
      const Clock::time_point start = Clock::now();
      CheckOk(Verify(ckpt, VerifyOptions{.num_threads = 1, .storage = storage(map)}).status(),
              "verify");
      return Seconds(start);
    };
    // The second half of every tensor, every chunk checked whole.
    auto partial_load = [&](bool map) {
      std::vector<std::vector<uint8_t>> out;
      StateDict part;
      for (size_t i = 0; i < data.size(); ++i) {
        out.emplace_back(per_tensor / 2);
        CheckOk(part.Add(ShardedTensor::Shard(
                    "t" + std::to_string(i),
                    TensorView(out.back().data(), DType::kU8, {per_tensor / 2}), {per_tensor},
                    {per_tensor / 2})),
                "state");
      }
      LoadOptions lo;
      lo.storage = storage(map);
      lo.verify_partial_chunks = true;
      const Clock::time_point start = Clock::now();
      CheckOk(Load(part, ckpt, lo).status(), "partial load");
      return Seconds(start);
    };
    Print("tessera_seconds",
          RunAll(o.rounds, {{"verify_mapped", [&] { return verify(true); }},
                            {"verify_pread", [&] { return verify(false); }},
                            {"partial_chunk_load_mapped", [&] { return partial_load(true); }},
                            {"partial_chunk_load_pread", [&] { return partial_load(false); }}}),
          true);
  }
  std::printf("}\n");
  return 0;
}
