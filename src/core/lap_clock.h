// LapClock: seconds of wall-clock time between laps (a save's phases, SaveReport).
#ifndef TESSERA_CORE_LAP_CLOCK_H_
#define TESSERA_CORE_LAP_CLOCK_H_

#include <chrono>

namespace tessera {

class LapClock {
 public:
  // Seconds since the previous Lap(), or since the clock was made.
  double Lap() {
    const auto now = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return seconds;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

}  // namespace tessera

#endif  // TESSERA_CORE_LAP_CLOCK_H_
