// Test helpers over the commits of a tessera directory (docs/FORMAT.md, section 4): which file
// holds the checkpoint now, for tests that read, damage or replace it. Header-only: the checkpoint
// tests include it; the layers below do not link the format code it uses.
#ifndef TESSERA_TESTING_COMMITS_H_
#define TESSERA_TESTING_COMMITS_H_

#include <algorithm>
#include <string>
#include <vector>

#include "format/tessera/manifest.h"
#include "tessera/storage.h"

namespace tessera::testing {

// The names among `names` that are commits ("tessera.manifest.<n>", "tessera.manifest").
inline std::vector<std::string> CommitNames(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& n : names) {
    uint64_t seq = 0;
    if (ParseCommitName(n, &seq)) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The path of the commit with the highest number in `dir`; "" when there is none.
inline std::string CommitPath(Storage& storage, const std::string& dir) {
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (!names.ok()) return "";
  const std::vector<std::string> commits = CommitNames(*names);
  return commits.empty() ? "" : JoinPath(dir, commits.back());
}
inline std::string CommitPath(const std::string& dir) {
  return CommitPath(*NewPosixStorage(), dir);
}

inline bool HasCommit(Storage& storage, const std::string& dir) {
  return !CommitPath(storage, dir).empty();
}

// The names a committed directory holds besides data files: its commit and the hint.
inline std::vector<std::string> CommitFiles(Storage& storage, const std::string& dir) {
  const std::string path = CommitPath(storage, dir);
  std::vector<std::string> out = {std::string(kSequenceHintFileName)};
  if (!path.empty()) out.push_back(path.substr(path.find_last_of('/') + 1));
  return out;
}

}  // namespace tessera::testing

#endif  // TESSERA_TESTING_COMMITS_H_
