// A progress bar on a terminal: one line on stderr, redrawn in place, for the long commands
// (convert). Library calls report progress through a callback (done, total) from one thread;
// hand Update to it. Nothing is drawn when disabled (stderr is not a terminal, or --quiet).
#ifndef TESSERA_TOOLS_PROGRESS_H_
#define TESSERA_TOOLS_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <string>

namespace tessera::tools {

// Whether stderr is a terminal (where a bar is drawn unless asked otherwise).
bool StderrIsTerminal();

class ProgressBar {
 public:
  // `label` starts the line, e.g. "convert". Draws only when `enabled`.
  ProgressBar(std::string label, bool enabled);
  // Ends the line if anything was drawn.
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Redraws "label  42% [=========>           ] 1.2 GB / 2.9 GB, 350.0 MB/s": at most every
  // 100 ms, and always when done == total. Call from one thread.
  void Update(uint64_t done, uint64_t total);
  // Ends the line (later Updates start a new one).
  void Finish();

 private:
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_PROGRESS_H_
