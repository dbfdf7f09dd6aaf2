// Runs the Format conformance suite (tessera/testing/format_suite.h) on every format tessera
// has: the registered ones, and raw_dir, a test-only format (src/format/testing/), which each
// case registers for its duration; each case where it applies.
#include "tessera/testing/format_suite.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "format/registry.h"
#include "format/testing/raw_dir_format.h"
#include "format/torch_dist/torch_zip.h"

// Named after the formats: the tests are tessera/FormatTest.RoundTrip, ...
TESSERA_INSTANTIATE_FORMAT_SUITE(tessera, tessera::FormatOf(tessera::CheckpointFormat::kTessera),
                                 .index_checksum = true);
// Objects saved as torch.save archives: torch_dist checks their zip records.
TESSERA_INSTANTIATE_FORMAT_SUITE(torch_dist,
                                 tessera::FormatOf(tessera::CheckpointFormat::kTorchDist),
                                 .make_object_bytes = tessera::torch_dist::MakeTorchBytesItem);
TESSERA_INSTANTIATE_FORMAT_SUITE(safetensors,
                                 tessera::FormatOf(tessera::CheckpointFormat::kSafetensors));
TESSERA_INSTANTIATE_FORMAT_SUITE(raw_dir, tessera::testing::RawDirFormat(),
                                 .register_for_test = true, .index_checksum = true);

namespace tessera {
namespace {

using ::testing::Contains;
using ::testing::ElementsAreArray;

// The cases registered for each instantiation above: <name>/FormatTest.<case>.
std::map<std::string, std::vector<std::string>> RegisteredCases() {
  const std::string group = "/FormatTest";
  std::map<std::string, std::vector<std::string>> cases;
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(i);
    const std::string name = suite.name();
    if (!name.ends_with(group)) continue;
    std::vector<std::string>& names = cases[name.substr(0, name.size() - group.size())];
    for (int j = 0; j < suite.total_test_count(); ++j)
      names.push_back(suite.GetTestInfo(j)->name());
  }
  return cases;
}

// Which cases each format runs: a case that does not apply is absent, not a passing no-op.
TEST(FormatSuiteTest, CasesThatDoNotApplyAreAbsent) {
  std::map<std::string, std::vector<std::string>> cases = RegisteredCases();
  ASSERT_EQ(cases.size(), 4u);
  // What was registered is what the capabilities the suite asks each format select.
  const std::map<std::string, testing::FormatUnderTest> formats = {
      {"tessera", {&FormatOf(CheckpointFormat::kTessera), {.index_checksum = true}}},
      {"torch_dist", {&FormatOf(CheckpointFormat::kTorchDist), {}}},
      {"safetensors", {&FormatOf(CheckpointFormat::kSafetensors), {}}},
      {"raw_dir", {&testing::RawDirFormat(), {.register_for_test = true, .index_checksum = true}}},
  };
  for (const auto& [name, format] : formats) {
    EXPECT_THAT(cases[name],
                ElementsAreArray(testing::FormatSuiteCaseNames(testing::CapabilitiesOf(format))))
        << name;
  }
  for (const auto& [format, names] : cases) {
    for (const char* every :
         {"RoundTrip", "Reshard2To3", "ConvertBothWays", "ACrashAtEveryStorageOperation",
          "ATruncatedIndexIsAnErrorNamingIt", "AFlippedIndexByteNeverLoadsWrongTensors"}) {
      EXPECT_THAT(names, Contains(every)) << format;
    }
  }
  const std::vector<std::string> all = {"RoundTrip",
                                        "Reshard2To3",
                                        "ConvertBothWays",
                                        "VerifyNamesAFlippedDataByte",
                                        "ACrashAtEveryStorageOperation",
                                        "ATruncatedIndexIsAnErrorNamingIt",
                                        "AFlippedIndexByteIsAnErrorNamingIt",
                                        "AFlippedIndexByteNeverLoadsWrongTensors",
                                        "AFlippedIndexByteNeverLoadsWrongObjects"};
  EXPECT_EQ(cases["tessera"], all);
  EXPECT_EQ(cases["raw_dir"], all);
  std::vector<std::string> torch_dist = all;
  std::erase(torch_dist, "AFlippedIndexByteIsAnErrorNamingIt");
  // Its zip records have CRC-32s; its byte items may be raw bytes, with none.
  std::erase(torch_dist, "AFlippedIndexByteNeverLoadsWrongObjects");
  EXPECT_EQ(cases["torch_dist"], torch_dist);
  std::vector<std::string> safetensors = torch_dist;
  std::erase(safetensors, "VerifyNamesAFlippedDataByte");  // no checksums, no objects
  EXPECT_EQ(cases["safetensors"], safetensors);
}

}  // namespace
}  // namespace tessera
