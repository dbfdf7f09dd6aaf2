// Text for people: terminal width, lines that fit it, names safe to print, times, and the
// order people expect keys in.
#ifndef TESSERA_TOOLS_TEXT_H_
#define TESSERA_TOOLS_TEXT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::tools {

// Columns of the terminal stdout is, else $COLUMNS, else 100.
int OutputWidth();

// `s` as it is when it is UTF-8 text without control characters, else quoted with every
// other byte escaped (core/utf8.h): what a checkpoint holds never reaches a terminal raw.
std::string Printable(const std::string& s);

// Display width of UTF-8 text (code points; every one taken as one column).
size_t DisplayWidth(std::string_view s);
// `s` cut to at most `width` columns, ending in "..." when cut (at a code point boundary).
std::string FitEnd(const std::string& s, size_t width);
// `s` cut in the middle to at most `width` columns: "decoder.lay...fc1.weight".
std::string FitMiddle(const std::string& s, size_t width);
// `s` in pieces of at most `width` columns (at least one piece).
std::vector<std::string> Wrap(const std::string& s, size_t width);
// `s` padded with spaces to `width` columns (left-aligned), or right-aligned.
std::string PadRight(const std::string& s, size_t width);
std::string PadLeft(const std::string& s, size_t width);

// "2024-05-01 12:00:03" in local time, or "-" for 0.
std::string FormatTime(int64_t unix_ms);

// The names among `keys` and their dotted prefixes ("a.b.c" gives "a.", "a.b.", "a.b.c") closest
// to `wanted` by edit distance, at most `limit`, closest first; none when nothing is close (more
// than half of `wanted`'s length away). For "did you mean" in an error.
std::vector<std::string> ClosestNames(const std::string& wanted,
                                      const std::vector<std::string>& keys, size_t limit = 3);

// Keys in the order people read them: digit runs compare as numbers, so "layers.2" comes
// before "layers.10"; otherwise bytewise.
bool NaturalLess(std::string_view a, std::string_view b);

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_TEXT_H_
