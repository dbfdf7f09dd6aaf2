// Runs the Format conformance suite (src/suite/format_suite.h) on every format of Formats(): the
// registered ones, and test-only ones (src/format/testing/), which each case registers for its
// duration; each case where it applies.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "format/registry.h"
#include "format/testing/raw_dir_format.h"
#include "suite/format_suite.h"

namespace tessera {
namespace {

using ::testing::Contains;

std::vector<suite::FormatUnderTest> Formats() {
  return {
      {&FormatOf(CheckpointFormat::kTessera), false, /*index_checksum=*/true},
      {&FormatOf(CheckpointFormat::kTorchDist), false, /*index_checksum=*/false},
      {&FormatOf(CheckpointFormat::kSafetensors), false, /*index_checksum=*/false},
      {&testing::RawDirFormat(), /*register_for_test=*/true, /*index_checksum=*/true},
  };
}

struct Param {
  suite::FormatCase test_case;
  suite::FormatUnderTest format;
  friend void PrintTo(const Param& p, std::ostream* os) {
    *os << p.test_case.name << " on " << p.format.format->name();
  }
};

std::vector<Param> AllParams() {
  std::vector<Param> out;
  for (const suite::FormatUnderTest& format : Formats()) {
    const suite::FormatCapabilities caps = suite::CapabilitiesOf(format);
    for (const suite::FormatCase& c : suite::FormatCases()) {
      if (c.applies(caps)) out.push_back({c, format});
    }
  }
  return out;
}

class FormatSuiteTest : public ::testing::TestWithParam<Param> {};

TEST_P(FormatSuiteTest, Passes) {
  const Param& p = GetParam();
  const Status status = suite::RunFormatCase(p.test_case, p.format);
  EXPECT_TRUE(status.ok()) << status.ToString();
}

INSTANTIATE_TEST_SUITE_P(AllFormats, FormatSuiteTest, ::testing::ValuesIn(AllParams()),
                         [](const auto& info) {
                           return std::string(info.param.format.format->name()) + "_" +
                                  info.param.test_case.name;
                         });

// Which cases each format runs: a case that does not apply is absent, not a passing no-op.
TEST(FormatSuiteTest, CasesThatDoNotApplyAreAbsent) {
  std::map<std::string, std::vector<std::string>> cases;
  for (const Param& p : AllParams()) cases[p.format.format->name()].push_back(p.test_case.name);
  EXPECT_EQ(cases.size(), Formats().size());
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
