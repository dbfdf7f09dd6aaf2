#include "tools/progress.h"

#include <unistd.h>

#include <cstdio>

#include "tools/commands.h"

namespace tessera::tools {
namespace {

constexpr int kBarWidth = 30;
constexpr auto kRedrawInterval = std::chrono::milliseconds(100);

}  // namespace

bool StderrIsTerminal() { return ::isatty(STDERR_FILENO) == 1; }

ProgressBar::ProgressBar(std::string label, bool enabled)
    : label_(std::move(label)), enabled_(enabled), start_(std::chrono::steady_clock::now()) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Update(uint64_t done, uint64_t total) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total && now - last_ < kRedrawInterval) return;
  last_ = now;
  const double fraction = total == 0 ? 1.0 : static_cast<double>(done) / static_cast<double>(total);
  const int filled = static_cast<int>(fraction * kBarWidth);
  std::string bar(kBarWidth, ' ');
  for (int i = 0; i < filled && i < kBarWidth; ++i) bar[i] = '=';
  if (filled < kBarWidth) bar[filled] = '>';
  const double seconds = std::chrono::duration<double>(now - start_).count();
  const std::string rate =
      seconds > 0 ? FormatBytes(static_cast<uint64_t>(done / seconds)) + "/s" : std::string("-");
  // \r back to the start, \033[K clears what a longer earlier line left.
  std::fprintf(stderr, "\r%s %3d%% [%s] %s / %s, %s\033[K", label_.c_str(),
               static_cast<int>(fraction * 100), bar.c_str(), FormatBytes(done).c_str(),
               FormatBytes(total).c_str(), rate.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressBar::Finish() {
  if (!drawn_) return;
  std::fputc('\n', stderr);
  std::fflush(stderr);
  drawn_ = false;
}

}  // namespace tessera::tools
