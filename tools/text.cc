#include "tools/text.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <set>
#include <vector>

#include "core/utf8.h"

namespace tessera::tools {
namespace {

bool IsContinuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// Byte length of the first `columns` code points of `s`.
size_t PrefixBytes(std::string_view s, size_t columns) {
  size_t i = 0;
  for (size_t seen = 0; i < s.size(); ++i) {
    if (!IsContinuation(s[i]) && seen++ == columns) break;
  }
  return i;
}

}  // namespace

int OutputWidth() {
  winsize ws{};
  if (isatty(STDOUT_FILENO) && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) {
    return ws.ws_col;
  }
  if (const char* columns = std::getenv("COLUMNS")) {
    const int n = std::atoi(columns);
    if (n > 0) return n;
  }
  return 100;
}

std::string Printable(const std::string& s) {
  const bool plain = IsValidUtf8(s) && std::none_of(s.begin(), s.end(), [](char c) {
                       return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
                     });
  return plain ? s : QuoteBytes(s);
}

size_t DisplayWidth(std::string_view s) {
  return static_cast<size_t>(
      std::count_if(s.begin(), s.end(), [](char c) { return !IsContinuation(c); }));
}

std::string FitEnd(const std::string& s, size_t width) {
  if (DisplayWidth(s) <= width) return s;
  if (width <= 3) return std::string(width, '.');
  return s.substr(0, PrefixBytes(s, width - 3)) + "...";
}

std::string FitMiddle(const std::string& s, size_t width) {
  const size_t n = DisplayWidth(s);
  if (n <= width) return s;
  if (width <= 3) return std::string(width, '.');
  const size_t head = (width - 3 + 1) / 2, tail = width - 3 - head;
  return s.substr(0, PrefixBytes(s, head)) + "..." + s.substr(PrefixBytes(s, n - tail));
}

std::vector<std::string> Wrap(const std::string& s, size_t width) {
  std::vector<std::string> pieces;
  std::string_view rest = s;
  do {
    const size_t n = PrefixBytes(rest, std::max<size_t>(width, 1));
    pieces.emplace_back(rest.substr(0, n));
    rest.remove_prefix(n);
  } while (!rest.empty());
  return pieces;
}

std::string PadRight(const std::string& s, size_t width) {
  const size_t n = DisplayWidth(s);
  return n >= width ? s : s + std::string(width - n, ' ');
}

std::string PadLeft(const std::string& s, size_t width) {
  const size_t n = DisplayWidth(s);
  return n >= width ? s : std::string(width - n, ' ') + s;
}

std::string FormatTime(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm local{};
  localtime_r(&t, &local);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &local);
  return buf;
}

bool NaturalLess(std::string_view a, std::string_view b) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      // Compare the numbers without their leading zeros: by length, then by digits.
      size_t iz = i, jz = j;
      while (iz + 1 < ie && a[iz] == '0') ++iz;
      while (jz + 1 < je && b[jz] == '0') ++jz;
      const std::string_view x = a.substr(iz, ie - iz), y = b.substr(jz, je - jz);
      if (x.size() != y.size()) return x.size() < y.size();
      if (x != y) return x < y;
      if (ie - i != je - j) return ie - i < je - j;  // "01" after "1"
      i = ie, j = je;
      continue;
    }
    if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
    ++i, ++j;
  }
  return a.size() - i < b.size() - j;
}

namespace {

// Levenshtein distance, stopping early past `cap` (returns cap + 1).
size_t EditDistance(std::string_view a, std::string_view b, size_t cap) {
  if (a.size() > b.size() + cap || b.size() > a.size() + cap) return cap + 1;
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    size_t best = row[0];
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
      best = std::min(best, row[j]);
    }
    if (best > cap) return cap + 1;
  }
  return row[b.size()];
}

}  // namespace

std::vector<std::string> ClosestNames(const std::string& wanted,
                                      const std::vector<std::string>& keys, size_t limit) {
  std::set<std::string> names;
  for (const std::string& key : keys) {
    for (size_t dot = key.find('.'); dot != std::string::npos; dot = key.find('.', dot + 1)) {
      names.insert(key.substr(0, dot + 1));
    }
    names.insert(key);
  }
  const size_t cap = std::max<size_t>(1, wanted.size() / 2);
  std::vector<std::pair<size_t, std::string>> scored;
  for (const std::string& name : names) {
    // A prefix of the wanted text's length compares like for like ("optimzer." ~ "optimizer.").
    const size_t d = EditDistance(wanted, name, cap);
    if (d <= cap) scored.emplace_back(d, name);
  }
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < limit; ++i) out.push_back(scored[i].second);
  return out;
}

}  // namespace tessera::tools
