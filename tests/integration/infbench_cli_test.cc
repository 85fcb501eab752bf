// `kvtier infinite --data`: ∞-Bench's task files through the C++ model path, with the
// benchmark's prompts, truncation and scoring, resumable predictions.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace kvtier {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string Weights() { return std::string(KVTIER_SOURCE_DIR) + "/models/kvtier-tiny.safetensors"; }
std::string Fixtures() { return std::string(KVTIER_SOURCE_DIR) + "/tests/data/infbench"; }

json ReadJson(const std::string& path) { return json::parse(test::ReadAll(path)); }

std::vector<json> ReadLines(const std::string& path) {
  std::vector<json> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

// The generator's samples written as a task file give, through --data, the same predictions
// and the same accuracy as the generator's own path, for every method of --compare.
TEST(InfBenchCli, GeneratorSamplesScoreTheSameThroughData) {
  for (const std::string task : {"passkey", "number_string", "kv_retrieval"}) {
    TempDir dir;
    const std::string common = "--task " + task + " --contexts 1024,2048 --samples 2 --seed 3";
    auto w = test::Kvtier("infinite " + common + " --write-data " + dir.path() + "/data");
    ASSERT_EQ(w.code, 0) << w.out;
    auto gen = test::Kvtier("infinite --weights " + Weights() + " " + common + " --compare --quiet --json " +
                            dir.path() + "/gen.json");
    ASSERT_EQ(gen.code, 0) << gen.out;
    auto data = test::Kvtier("infinite --weights " + Weights() + " --data " + dir.path() +
                             "/data --compare --quiet " + "--predictions " + dir.path() + "/preds --json " +
                             dir.path() + "/data.json");
    ASSERT_EQ(data.code, 0) << data.out;
    const json g = ReadJson(dir.path() + "/gen.json"), d = ReadJson(dir.path() + "/data.json");
    for (const json& m : d["methods"]) {
      const std::string name = m["name"];
      std::vector<std::string> outputs;
      int correct = 0, samples = 0;
      for (const json& r : g["results"])
        if (r["method"] == name && !r["skipped"].get<bool>()) {
          for (const json& o : r["outputs"]) outputs.push_back(o);
          correct += r["correct"].get<int>();
          samples += r["samples"].get<int>();
        }
      ASSERT_EQ(samples, 4) << task << " " << name;
      std::string slug = name;
      std::replace(slug.begin(), slug.end(), ' ', '_');
      std::transform(slug.begin(), slug.end(), slug.begin(), [](unsigned char c) { return std::tolower(c); });
      const auto preds = ReadLines(dir.path() + "/preds/" + slug + "/preds_" + task + ".jsonl");
      ASSERT_EQ(preds.size(), outputs.size()) << task << " " << name;
      for (size_t i = 0; i < preds.size(); ++i)
        EXPECT_EQ(preds[i]["prediction"].get<std::string>(), outputs[i])
            << task << " " << name << " sample " << i;
      for (const json& r : d["results"])
        if (r["method"] == name)
          EXPECT_DOUBLE_EQ(r["score"].get<double>(), static_cast<double>(correct) / samples);
    }
  }
}

// Every task kind of the official schema runs, with each template family, and each writes its
// predictions where the benchmark's scorer looks for them.
TEST(InfBenchCli, EveryTaskOfTheOfficialSchemaRuns) {
  for (const std::string family : {"gpt4", "yarn-mistral"}) {
    TempDir dir;
    auto r = test::Kvtier("infinite --weights " + Weights() + " --data " + Fixtures() + " --template " +
                          family + " --max-new-tokens 4 --quiet --predictions " + dir.path() + " --json " +
                          dir.path() + "/r.json");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("| longbook_choice_eng "), std::string::npos) << r.out;
    const json rep = ReadJson(dir.path() + "/r.json");
    ASSERT_EQ(rep["tasks"].size(), 12u);
    for (const json& t : rep["tasks"]) {
      const auto preds = ReadLines(dir.path() + "/kvtier/preds_" + t.get<std::string>() + ".jsonl");
      ASSERT_FALSE(preds.empty()) << t;
      EXPECT_TRUE(preds[0].contains("ground_truth") && preds[0].contains("prediction")) << preds[0];
    }
    for (const json& res : rep["results"]) {
      EXPECT_EQ(res["run"]["tokens"].get<uint64_t>() > 0, true) << res;
      EXPECT_GT(res["run"]["peak_rss_bytes"].get<uint64_t>(), 0u);
    }
  }
}

// --truncate cuts each prompt to that many tokens (bytes for kvtier-tiny): a sample then runs
// truncate + budget - 1 tokens through the model.
TEST(InfBenchCli, TruncationBoundsThePromptInTokens) {
  TempDir dir;
  ASSERT_EQ(
      test::Kvtier("infinite --task passkey --contexts 2048 --samples 2 --write-data " + dir.path()).code, 0);
  auto r = test::Kvtier("infinite --weights " + Weights() + " --data " + dir.path() +
                        "/passkey.jsonl --truncate 700 --quiet --predictions " + dir.path() + "/p --json " +
                        dir.path() + "/r.json");
  ASSERT_EQ(r.code, 0) << r.out;
  const json rep = ReadJson(dir.path() + "/r.json");
  EXPECT_EQ(rep["results"][0]["run"]["tokens"].get<uint64_t>(), 2u * (700 + 5 - 1));
}

// A run killed with SIGKILL keeps every finished prediction; the next run skips them, and its
// predictions and score are those of a run that was never interrupted.
TEST(InfBenchCli, AKilledRunResumesWhereItStopped) {
  TempDir dir;
  ASSERT_EQ(
      test::Kvtier("infinite --task passkey --contexts 16384 --samples 4 --write-data " + dir.path()).code,
      0);
  const std::string run =
      "infinite --weights " + Weights() + " --data " + dir.path() + "/passkey.jsonl --quiet ";
  const std::string preds = dir.path() + "/killed/kvtier/preds_passkey.jsonl";
  // Started in the background, killed once its first prediction is written.
  const std::string script = "cd " + dir.path() + " && (" + std::string(KVTIER_BINARY_DIR) + "/kvtier " +
                             run +
                             "--predictions killed > /dev/null 2>&1 & pid=$!; for i in $(seq 1 600); do "
                             "[ -s " +
                             preds + " ] && break; sleep 0.02; done; kill -9 $pid; wait $pid; echo killed)";
  FILE* p = popen(script.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[64] = {};
  fgets(buf, sizeof buf, p);
  pclose(p);
  ASSERT_EQ(std::string(buf), "killed\n");
  const size_t before = ReadLines(preds).size();
  ASSERT_GE(before, 1u);
  EXPECT_LT(before, 4u) << "the run was not interrupted";
  auto resumed = test::Kvtier(run + "--predictions " + dir.path() + "/killed");
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("over 4 samples (" + std::to_string(before) + " from"), std::string::npos)
      << "before " << before << "\n"
      << resumed.out;
  auto whole = test::Kvtier(run + "--predictions " + dir.path() + "/whole");
  ASSERT_EQ(whole.code, 0) << whole.out;
  const auto a = ReadLines(preds), b = ReadLines(dir.path() + "/whole/kvtier/preds_passkey.jsonl");
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a, b);
  // A finished run runs nothing again.
  auto again = test::Kvtier(run + "--predictions " + dir.path() + "/whole");
  EXPECT_NE(again.out.find("over 4 samples (4 from"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("0 run now"), std::string::npos) << again.out;
}

TEST(InfBenchCli, BadDataAndFlagsAreNamed) {
  TempDir dir;
  {
    std::ofstream(dir.path() + "/passkey.jsonl") << R"({"id": 0, "context": "c", "input": "i"})"
                                                 << "\n";
  }
  auto r = test::Kvtier("infinite --weights " + Weights() + " --data " + dir.path() + " --quiet");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(dir.path() + "/passkey.jsonl:1: field 'answer' is missing"), std::string::npos)
      << r.out;
  r = test::Kvtier("infinite --weights " + Weights() + " --data " + dir.path() + "/none --quiet");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("does not exist"), std::string::npos) << r.out;
  r = test::Kvtier("infinite --weights " + Weights() + " --data " + Fixtures() + " --template llama-9");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("unknown ∞-Bench template family"), std::string::npos) << r.out;
  r = test::Kvtier("infinite --weights " + Weights() + " --truncate 100");
  EXPECT_EQ(r.code, 2) << r.out;
  // Predictions made from other data are not mixed in.
  TempDir a, b;
  ASSERT_EQ(
      test::Kvtier("infinite --task passkey --contexts 1024 --samples 1 --seed 1 --write-data " + a.path())
          .code,
      0);
  ASSERT_EQ(
      test::Kvtier("infinite --task passkey --contexts 1024 --samples 1 --seed 2 --write-data " + b.path())
          .code,
      0);
  const std::string preds = " --quiet --predictions " + dir.path() + "/p";
  ASSERT_EQ(test::Kvtier("infinite --weights " + Weights() + " --data " + a.path() + preds).code, 0);
  r = test::Kvtier("infinite --weights " + Weights() + " --data " + b.path() + preds);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("was made from other data"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace kvtier
