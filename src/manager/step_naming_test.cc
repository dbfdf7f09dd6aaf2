// Step directory names other than Megatron-LM's (issue 30, item 3): presets and patterns, a
// manager over a torchtitan or Hugging Face root, and the error for a root whose directories
// are named otherwise than the manager was told.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "manager/root_files.h"
#include "tessera/checkpoint.h"
#include "tessera/checkpoint_manager.h"
#include "tessera/memory_storage.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

StepNaming Naming(std::string_view spec) {
  Result<StepNaming> naming = ParseStepNaming(spec);
  EXPECT_OK(naming.status());
  return naming.ok() ? *naming : StepNaming{};
}

TEST(StepNamingTest, PresetsNameAndParseTheirStepsOneSpellingEach) {
  struct Case {
    const char* preset;
    int64_t step;
    const char* name;
  };
  for (const Case& c : {Case{"megatron", 1000, "iter_0001000"}, Case{"torchtitan", 500, "step-500"},
                        Case{"huggingface", 42, "checkpoint-42"}, Case{"hf", 42, "checkpoint-42"},
                        Case{"step", 7, "step7"}, Case{"global_step", 0, "global_step0"}}) {
    const StepNaming naming = Naming(c.preset);
    EXPECT_EQ(naming.Name(c.step), c.name) << c.preset;
    EXPECT_EQ(naming.Parse(c.name), c.step) << c.preset;
    EXPECT_EQ(naming.Parse(naming.Name(INT64_MAX)), INT64_MAX) << c.preset;
    EXPECT_TRUE(ParseStepNaming(naming.Pattern()).ok()) << naming.Pattern();
  }
  // One spelling per step; presets do not take each other's names.
  EXPECT_EQ(Naming("torchtitan").Parse("step-007"), std::nullopt);
  EXPECT_EQ(Naming("torchtitan").Parse("step-"), std::nullopt);
  EXPECT_EQ(Naming("torchtitan").Parse("step--1"), std::nullopt);
  EXPECT_EQ(Naming("step").Parse("step-5"), std::nullopt);
  EXPECT_EQ(Naming("step").Parse("global_step5"), std::nullopt);
  EXPECT_EQ(Naming("huggingface").Parse("checkpoint-99999999999999999999"), std::nullopt);
  EXPECT_EQ(Naming("megatron").Parse("iter_00001000"), std::nullopt);
}

TEST(StepNamingTest, PatternsWithPaddingAndASuffix) {
  const StepNaming naming = Naming("ckpt_{step:06}.d");
  EXPECT_EQ(naming.prefix, "ckpt_");
  EXPECT_EQ(naming.min_digits, 6);
  EXPECT_EQ(naming.suffix, ".d");
  EXPECT_EQ(naming.Name(12), "ckpt_000012.d");
  EXPECT_EQ(naming.Parse("ckpt_000012.d"), 12);
  EXPECT_EQ(naming.Parse("ckpt_1234567.d"), 1234567);
  EXPECT_EQ(naming.Parse("ckpt_12.d"), std::nullopt);
  EXPECT_EQ(naming.Parse("ckpt_000012"), std::nullopt);
  EXPECT_EQ(naming.Pattern(), "ckpt_{step:06}.d");
  EXPECT_EQ(Naming("{step}").Name(3), "3");
  EXPECT_EQ(Naming("{step}").Parse("03"), std::nullopt);
}

TEST(StepNamingTest, ABadPatternIsRefusedSayingWhatIsWrong) {
  struct Case {
    const char* spec;
    const char* says;
  };
  for (const Case& c :
       {Case{"titan", "neither a preset nor a pattern"},
        Case{"", "presets: megatron (iter_{step:07})"}, Case{"ckpt_{step:6}", "{step:0N}"},
        Case{"ckpt_{step:020}", "1 to 19"}, Case{"ckpt_{step:0}", "{step:0N}"},
        Case{"ckpt_{stepx}", "{step:0N}"}, Case{"run/{step}", "names one directory"},
        Case{"{step}-{step}", "names one directory"}}) {
    Result<StepNaming> naming = ParseStepNaming(c.spec);
    EXPECT_EQ(naming.status().code(), StatusCode::kInvalidArgument) << c.spec;
    EXPECT_THAT(naming.status().message(), HasSubstr(c.says)) << c.spec;
  }
  // A StepNaming built by hand is checked by the manager: every operation says why.
  CheckpointManagerOptions options;
  options.storage = std::make_shared<MemoryStorage>();
  options.step_naming.prefix = "a/b";
  CheckpointManager manager("/r", options);
  Result<std::optional<int64_t>> latest = manager.LatestStep();
  EXPECT_EQ(latest.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(latest.status().message(), HasSubstr("names one directory"));
}

StateDict OneTensor(std::vector<float>& values) {
  StateDict dict;
  EXPECT_OK(dict.Add(ShardedTensor::Whole(
      "w", TensorView(values.data(), DType::kF32, {static_cast<int64_t>(values.size())}))));
  return dict;
}

// Saves steps 1..n with each value the step.
void SaveSteps(CheckpointManager& manager, int n) {
  for (int step = 1; step <= n; ++step) {
    std::vector<float> values(16, static_cast<float>(step));
    StateDict dict = OneTensor(values);
    ASSERT_OK(manager.Save(step, dict).status());
  }
  ASSERT_OK(manager.Wait());
}

// Options over `storage` naming steps as `naming` says.
CheckpointManagerOptions Over(std::shared_ptr<MemoryStorage> storage, std::string_view naming) {
  CheckpointManagerOptions options;
  options.storage = std::move(storage);
  options.step_naming = Naming(naming);
  return options;
}

// Saves steps 1..n under "/run" with a manager of `options`.
void SaveRoot(const CheckpointManagerOptions& options, int n) {
  CheckpointManager manager("/run", options);
  SaveSteps(manager, n);
}

TEST(StepNamingTest, AManagerOverATorchtitanRootSavesListsRestoresAndPrunes) {
  auto storage = std::make_shared<MemoryStorage>();
  const CheckpointManagerOptions options = Over(storage, "torchtitan");
  SaveRoot(options, 3);
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, storage->ListDir("/run"));
  EXPECT_THAT(names, ::testing::IsSupersetOf({"step-1", "step-2", "step-3"}));

  CheckpointManager manager("/run", options);
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, manager.LatestStep());
  EXPECT_EQ(latest, 3);
  EXPECT_EQ(manager.StepPath(3), "/run/step-3");
  std::vector<float> values(16, 0.0f);
  StateDict dict = OneTensor(values);
  ASSERT_OK_AND_ASSIGN(RestoreReport restored, manager.Restore(dict));
  EXPECT_EQ(restored.step, 3);
  EXPECT_EQ(restored.path, "/run/step-3");
  EXPECT_EQ(values[0], 3.0f);
  ASSERT_OK_AND_ASSIGN(PruneReport pruned, manager.Prune({.keep_last = 1}));
  EXPECT_EQ(pruned.deleted, 2);
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> steps, manager.AllSteps());
  EXPECT_THAT(steps, ElementsAre(3));
}

TEST(StepNamingTest, ARootNamedByAnotherPresetIsAnErrorNamingThePreset) {
  auto storage = std::make_shared<MemoryStorage>();
  SaveRoot(Over(storage, "huggingface"), 2);
  CheckpointManager manager("/run", Over(storage, "megatron"));  // the default naming
  Result<std::optional<int64_t>> latest = manager.LatestStep();
  EXPECT_EQ(latest.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(latest.status().message(), HasSubstr("no step directory named \"iter_{step:07}\""));
  EXPECT_THAT(latest.status().message(), HasSubstr("\"checkpoint-1\", \"checkpoint-2\""));
  EXPECT_THAT(latest.status().message(), HasSubstr("pass the step naming \"huggingface\""));
  // Every reader of the root says the same; none says "no committed checkpoint".
  EXPECT_EQ(manager.Steps().status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(manager.Prune({.keep_last = 1}).status().code(), StatusCode::kInvalidArgument);
  std::vector<float> values(16, 0.0f);
  StateDict dict = OneTensor(values);
  Result<RestoreReport> restored = manager.Restore(dict);
  EXPECT_EQ(restored.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(restored.status().message(), HasSubstr("huggingface"));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, storage->ListDir("/run"));
  EXPECT_THAT(names, ::testing::IsSupersetOf({"checkpoint-1", "checkpoint-2"}));  // untouched
}

// A checkpoint saved at `path` by Save, not by a manager.
void SaveOneCheckpoint(const std::shared_ptr<MemoryStorage>& storage, const std::string& path) {
  std::vector<float> values(16, 1.0f);
  StateDict dict = OneTensor(values);
  SaveOptions save;
  save.storage = storage;
  ASSERT_OK(Save(dict, path, save).status());
}

TEST(StepNamingTest, CheckpointsUnderUnknownNamesAskForAPattern) {
  auto storage = std::make_shared<MemoryStorage>();
  SaveOneCheckpoint(storage, "/run/ckpt_000100");
  ASSERT_OK(storage->CreateDirs("/run/logs"));
  CheckpointManagerOptions options;
  options.storage = storage;
  CheckpointManager manager("/run", options);
  Result<std::optional<int64_t>> latest = manager.LatestStep();
  EXPECT_EQ(latest.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(latest.status().message(),
              HasSubstr("checkpoints under other names: \"ckpt_000100\""));
  EXPECT_THAT(latest.status().message(), HasSubstr("a pattern such as"));

  options.step_naming = Naming("ckpt_{step:06}");
  CheckpointManager named("/run", options);
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> found, named.LatestStep());
  EXPECT_EQ(found, 100);
}

TEST(StepNamingTest, ARootThatIsItselfACheckpointIsSaidSo) {
  auto storage = std::make_shared<MemoryStorage>();
  SaveOneCheckpoint(storage, "/run/iter_0000005");
  CheckpointManagerOptions options;
  options.storage = storage;
  CheckpointManager manager("/run/iter_0000005", options);
  Result<std::optional<int64_t>> latest = manager.LatestStep();
  EXPECT_EQ(latest.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(latest.status().message(), HasSubstr("is itself a checkpoint"));
}

TEST(StepNamingTest, AFreshRootBesideOtherThingsIsAFreshRun) {
  auto storage = std::make_shared<MemoryStorage>();
  ASSERT_OK(storage->CreateDirs("/run/logs"));
  ASSERT_OK(storage->CreateDirs("/run/tensorboard-2"));
  CheckpointManagerOptions options;
  options.storage = storage;
  CheckpointManager manager("/run", options);
  ASSERT_OK_AND_ASSIGN(std::optional<int64_t> latest, manager.LatestStep());
  EXPECT_EQ(latest, std::nullopt);
  std::vector<float> values(16, 0.0f);
  StateDict dict = OneTensor(values);
  EXPECT_EQ(manager.Restore(dict).status().code(), StatusCode::kNotFound);
  CheckpointManager missing("/nowhere", options);
  ASSERT_OK_AND_ASSIGN(latest, missing.LatestStep());
  EXPECT_EQ(latest, std::nullopt);
}

}  // namespace
}  // namespace tessera
