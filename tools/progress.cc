#include "tools/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>

#include "tools/commands.h"

namespace tessera::tools {
namespace {

// How often a bar is redrawn (or a line printed) at most, but for the last one.
constexpr auto kRedrawInterval = std::chrono::milliseconds(100);
// The shortest time a rate is measured over before it is shown: over less, a burst (chunks
// equal by checksum, bytes in the page cache) reads as hundreds of GB/s.
constexpr double kMinRateSeconds = 1.0;

int TerminalColumns(FILE* out) {
  winsize ws{};
  if (ioctl(fileno(out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 80;
}

}  // namespace

ProgressMode ProgressFlags::Mode() const {
  if (quiet) return ProgressMode::kQuiet;
  return progress ? ProgressMode::kForce : ProgressMode::kAuto;
}

void AddProgressFlags(CLI::App& command, ProgressFlags& flags) {
  CLI::Option* progress = command.add_flag(
      "--progress", flags.progress,
      "show progress on stderr even when it is not a terminal (one line per update)");
  command.add_flag("--quiet", flags.quiet, "show no progress")->excludes(progress);
}

std::string FormatDuration(double seconds) {
  const long long s = seconds > 0 ? static_cast<long long>(seconds + 0.5) : 0;
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", s / 60, s % 60);
  }
  return buf;
}

ProgressBar::ProgressBar(std::string label, ProgressMode mode, FILE* out)
    : label_(std::move(label)), out_(out) {
  const bool terminal = isatty(fileno(out)) == 1;
  if (mode == ProgressMode::kQuiet || (mode == ProgressMode::kAuto && !terminal)) {
    mode_ = Mode::kOff;
  } else {
    mode_ = terminal ? Mode::kTerminal : Mode::kLines;
  }
}

ProgressBar::~ProgressBar() { Finish(); }

std::function<void(uint64_t, uint64_t)> ProgressBar::Callback() {
  return [this](uint64_t done, uint64_t total) { Update(done, total); };
}

std::function<void(uint64_t, uint64_t)> ProgressBar::RankCallback(int rank, int num_ranks) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (ranks_.size() < static_cast<size_t>(num_ranks)) {
      ranks_.resize(num_ranks);
      rank_seen_.resize(num_ranks, false);
    }
  }
  return [this, rank](uint64_t done, uint64_t total) {
    std::lock_guard<std::mutex> lock(mutex_);
    ranks_[rank] = {done, total};
    rank_seen_[rank] = true;
    if (!std::all_of(rank_seen_.begin(), rank_seen_.end(), [](bool b) { return b; })) return;
    uint64_t sum_done = 0, sum_total = 0;
    for (const auto& [d, t] : ranks_) sum_done += d, sum_total += t;
    done_ = sum_done, total_ = sum_total;
    DrawLocked(false);
  };
}

void ProgressBar::Update(uint64_t done, uint64_t total) {
  std::lock_guard<std::mutex> lock(mutex_);
  done_ = done, total_ = total;
  DrawLocked(false);
}

void ProgressBar::Finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_ || !drawn_) return;
  finished_ = true;
  DrawLocked(true);
}

std::string ProgressBar::Line(bool final) const {
  // Up to now, or to when the work reached its total (what follows is not its time).
  const Clock::time_point end = reached_total_ ? reached_at_ : Clock::now();
  const double elapsed = std::chrono::duration<double>(end - start_).count();
  // The rate over what this bar saw, on a terminal only and over at least kMinRateSeconds. Off a
  // terminal (a log) the lines give bytes and percent, and the last one the time taken: a rate
  // there is read long after and out of context, and one measured over a burst is meaningless.
  const double rate = mode_ == Mode::kTerminal && elapsed >= kMinRateSeconds
                          ? (done_ - std::min(done_, done_at_start_)) / elapsed
                          : 0;
  const int percent = total_ ? static_cast<int>(done_ * 100 / total_) : 100;
  const std::string amounts = FormatBytes(done_) + " / " + FormatBytes(total_);
  const std::string speed = rate > 0 ? FormatBytes(static_cast<uint64_t>(rate)) + "/s" : "";
  std::string when;
  if (final) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "done in %.1f s", elapsed);
    when = buf;
  } else {
    when = rate > 0 && done_ <= total_ ? FormatDuration((total_ - done_) / rate) + " left" : "";
  }
  std::string parts;  // ", speed, when" for lines; "  speed  when" for the bar
  const char* sep = mode_ == Mode::kLines ? ", " : "  ";
  for (const std::string* p : {&speed, static_cast<const std::string*>(&when)}) {
    if (!p->empty()) parts += sep + *p;
  }
  if (mode_ == Mode::kLines) {
    return label_ + ": " + amounts + " (" + std::to_string(percent) + "%)" + parts;
  }
  // "label [####......]  amounts  speed  when", the bar taking what the terminal leaves.
  const std::string tail = "  " + amounts + parts;
  const int columns = TerminalColumns(out_) - 1;  // never the last column: no wrap
  const int bar = std::min<int>(40, columns - static_cast<int>(label_.size() + 3 + tail.size()));
  if (bar < 5) return (label_ + tail).substr(0, std::max(columns, 0));
  const int filled = total_ ? static_cast<int>(static_cast<double>(done_) / total_ * bar) : bar;
  return label_ + " [" + std::string(std::min(filled, bar), '#') +
         std::string(bar - std::min(filled, bar), '.') + "]" + tail;
}

void ProgressBar::DrawLocked(bool final) {
  if (mode_ == Mode::kOff || finished_ != final) return;
  const Clock::time_point now = Clock::now();
  if (!started_) {  // the clock runs from the first update drawn
    start_ = now, done_at_start_ = done_, started_ = true;
  }
  if (!reached_total_ && total_ > 0 && done_ >= total_) reached_total_ = true, reached_at_ = now;
  if (!final && drawn_ && now - last_draw_ < kRedrawInterval) return;
  last_draw_ = now;
  drawn_ = true;
  const std::string line = Line(final);
  if (mode_ == Mode::kTerminal) {
    std::fprintf(out_, "\r%s\x1b[K%s", line.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

}  // namespace tessera::tools
