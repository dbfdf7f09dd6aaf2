// A progress bar for the tessera tool's long commands (demo, verify, rm-keys, convert): bytes
// done of total, rate and time left, on stderr. It is fed by the library's progress callbacks
// (SaveOptions::progress, LoadOptions::progress, VerifyOptions::progress,
// RemoveKeysOptions::progress).
//
//   ProgressBar bar("verify", flags.Mode());
//   options.progress = bar.Callback();
//   ... run ...
//   bar.Finish();   // before printing the result
//
// On a terminal: one line redrawn in place, at most every 100 ms, e.g.
//   verify [##########..........]  134.2 MB / 268.4 MB  1.21 GB/s  0:00 left
// Elsewhere (with --progress): one line per update (at most one per 100 ms), e.g.
//   verify: 134.2 MB / 268.4 MB (50%), 1.21 GB/s, 0:00 left
// and a last line "verify: 268.4 MB / 268.4 MB (100%), 1.21 GB/s, done in 0.2 s".
#ifndef TESSERA_TOOLS_PROGRESS_H_
#define TESSERA_TOOLS_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace tessera::tools {

enum class ProgressMode {
  kAuto,   // a bar when stderr is a terminal, nothing otherwise (default)
  kForce,  // --progress: a bar on a terminal, else one line per update
  kQuiet,  // --quiet: nothing
};

// The --progress and --quiet flags of a command.
struct ProgressFlags {
  bool progress = false;
  bool quiet = false;
  ProgressMode Mode() const;
};
void AddProgressFlags(CLI::App& command, ProgressFlags& flags);

class ProgressBar {
 public:
  // `label` starts every line. Draws on `out` (default stderr) as `mode` says.
  ProgressBar(std::string label, ProgressMode mode, FILE* out = stderr);
  ~ProgressBar();  // Finish()
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Whether anything is drawn.
  bool active() const { return mode_ != Mode::kOff; }
  // Thread-safe. Bytes done of `total`.
  void Update(uint64_t done, uint64_t total);
  // For the library's options: calls Update. The bar must outlive the operation.
  std::function<void(uint64_t, uint64_t)> Callback();
  // For `num_ranks` ranks of one process (threads, e.g. the demo's LocalComm ranks): the
  // callback of rank `rank`. The bar shows the sum over ranks once every rank has reported.
  std::function<void(uint64_t, uint64_t)> RankCallback(int rank, int num_ranks);
  // Draws the last line (the totals and the mean rate) and ends it. Idempotent; nothing when
  // no update came.
  void Finish();

 private:
  enum class Mode { kOff, kTerminal, kLines };
  using Clock = std::chrono::steady_clock;
  void DrawLocked(bool final);
  std::string Line(bool final) const;

  std::string label_;
  FILE* out_;
  Mode mode_;
  std::mutex mutex_;
  Clock::time_point start_{};
  bool started_ = false;
  uint64_t done_at_start_ = 0;
  bool reached_total_ = false;
  Clock::time_point reached_at_{};
  Clock::time_point last_draw_{};
  bool drawn_ = false;
  bool finished_ = false;
  uint64_t done_ = 0, total_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranks_;  // per rank: done, total
  std::vector<bool> rank_seen_;
};

// "1:05", "1:02:03" for a duration in seconds.
std::string FormatDuration(double seconds);

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_PROGRESS_H_
