// ∞-Bench's task files, prompts, truncation and scoring (integration/infbench/): each scoring
// rule on hand-computed cases, including the official scorer's edge cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "integration/infbench/predictions.h"
#include "integration/infbench/prompt.h"
#include "integration/infbench/score.h"
#include "integration/infbench/task_file.h"
#include "tests/test_util.h"

namespace kvtier::infbench {
namespace {

double Score(const std::string& task, const std::string& pred, const std::string& gt,
             const std::string& family = "") {
  auto r = ScoreOne(task, pred, gt, family);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : -1;
}

TEST(InfBenchScore, PasskeyAndNumberStringMatchTheFirstRunOfDigits) {
  EXPECT_EQ(Score("passkey", "The pass key is 71432.", R"(["71432"])"), 1);
  EXPECT_EQ(Score("passkey", "71432", R"("71432")"), 1);              // a bare string answer
  EXPECT_EQ(Score("passkey", "12345 and 71432", R"(["71432"])"), 0);  // only the first number counts
  EXPECT_EQ(Score("passkey", "7143", R"(["71432"])"), 0);
  EXPECT_EQ(Score("passkey", "key 071432", R"(["71432"])"), 0);
  EXPECT_EQ(Score("passkey", "no digits at all", R"(["71432"])"), 0);
  EXPECT_EQ(Score("passkey", "", R"(["71432"])"), 0);
  EXPECT_EQ(Score("number_string", "The sequence is 1234567890!", R"(["1234567890"])"), 1);
  EXPECT_EQ(Score("number_string", "1234567890123", R"(["1234567890"])"), 0);
}

TEST(InfBenchScore, KvRetrievalAndDialogueLookForTheAnswerAsAWord) {
  EXPECT_EQ(Score("kv_retrieval", "The value is \"2a8c-ff1\".", R"(["2a8c-ff1"])"), 1);
  EXPECT_EQ(Score("kv_retrieval", "{key: 2a8c-ff1}", R"(["2a8c-ff1"])"), 1);
  EXPECT_EQ(Score("kv_retrieval", "2a8c-ff1x", R"(["2a8c-ff1"])"), 0);
  EXPECT_EQ(Score("longdialogue_qa_eng", "I think it is John.", R"(["JOHN"])"), 1);
  EXPECT_EQ(Score("longdialogue_qa_eng", "Johnny", R"(["JOHN"])"), 0);
}

TEST(InfBenchScore, CodeRunTakesTheLastWordAsAnInteger) {
  EXPECT_EQ(Score("code_run", "The return value is: 42", "[42]"), 1);
  EXPECT_EQ(Score("code_run", "42.\n", "42"), 1);
  EXPECT_EQ(Score("code_run", "it returns -17", "[-17]"), 1);
  EXPECT_EQ(Score("code_run", "The answer is 42 units", "[42]"), 0);
  EXPECT_EQ(Score("code_run", "", "[42]"), 0);
}

TEST(InfBenchScore, CodeDebugReadsTheLetterOrTheFunctionAfterAPrefix) {
  const std::string gt = R"(["parse_header", "C"])";
  EXPECT_EQ(Score("code_debug", "C. parse_header", gt), 1);
  EXPECT_EQ(Score("code_debug", "C: it crashes", gt), 1);
  EXPECT_EQ(Score("code_debug", "The answer is: C", gt), 1);
  EXPECT_EQ(Score("code_debug", "The function is: parse_header", gt), 1);
  EXPECT_EQ(Score("code_debug", "The answer is: B", gt), 0);
  EXPECT_EQ(Score("code_debug", "I think B", gt), 0);
  // The benchmark looks at the first two characters before stripping: a leading space loses.
  EXPECT_EQ(Score("code_debug", " C. parse_header", gt), 0);
  EXPECT_EQ(Score("code_debug", "the answer is:", gt), 0);  // ends with the prefix
}

TEST(InfBenchScore, LongbookChoiceFollowsTheBenchmarksOrderOfRules) {
  const std::string gt = R"(["Paris", "B"])";
  EXPECT_EQ(Score("longbook_choice_eng", "B", gt), 1);
  EXPECT_EQ(Score("longbook_choice_eng", "A", gt), 0);
  EXPECT_EQ(Score("longbook_choice_eng", "The answer is: B", gt), 1);
  EXPECT_EQ(Score("longbook_choice_eng", "The answer is Paris", gt), 1);
  EXPECT_EQ(Score("longbook_choice_eng", "  B", gt), 1);  // the first word that is a piece of "ABCD"
  EXPECT_EQ(Score("longbook_choice_eng", "I'd say C or B", gt), 0);  // "C" comes first
  EXPECT_EQ(Score("longbook_choice_eng", "Paris", gt), 0);           // the text alone is not read
  EXPECT_EQ(Score("longbook_choice_eng", "", gt), 0);
}

TEST(InfBenchScore, MathFindComparesTheFirstNumberAsTheAnswersType) {
  EXPECT_EQ(Score("math_find", "The answer is 3.", "[3]"), 1);
  EXPECT_EQ(Score("math_find", "x 12 then 3", "[3]"), 0);
  EXPECT_EQ(Score("math_find", "3.5", "[3]"), 0);  // int("3.5") fails in the benchmark: no credit
  EXPECT_EQ(Score("math_find", "3.5", "[3.5]"), 1);
  EXPECT_EQ(Score("math_find", "3", "[3.5]"), 0);
  EXPECT_EQ(Score("math_find", "nothing", "[3]"), 0);
}

TEST(InfBenchScore, MathCalcCountsTheValuesMatchedFromTheStart) {
  EXPECT_DOUBLE_EQ(Score("math_calc", "[1, 4, 8]", "[1, 4, 8]"), 1.0);
  EXPECT_DOUBLE_EQ(Score("math_calc", "[1, 4, 9, 8]", "[1, 4, 8]"), 2.0 / 3);
  EXPECT_DOUBLE_EQ(Score("math_calc", "1, 3, 8", "[1, 4, 8]"), 1.0 / 3);
  EXPECT_DOUBLE_EQ(Score("math_calc", "Values: 5 1 4 8", "[1, 4, 8]", "gpt4"), 1.0);
  EXPECT_DOUBLE_EQ(Score("math_calc", "Values: 5 1 4 8", "[1, 4, 8]", "yarn-mistral"), 0.0);
  // Signs are dropped with the non-digits, as the benchmark's re.split does: a negative value
  // never matches.
  EXPECT_DOUBLE_EQ(Score("math_calc", "8, 5, -3", "[8, 5, -3]"), 2.0 / 3);
}

TEST(InfBenchScore, EnglishQaIsTokenF1AfterNormalisation) {
  // "eiffel tower in paris" against "eiffel tower": 2 shared, p 1/2, r 1.
  EXPECT_NEAR(Score("longbook_qa_eng", "Eiffel Tower, in Paris", R"(["the Eiffel Tower"])"), 2.0 / 3, 1e-12);
  EXPECT_NEAR(Score("longbook_qa_eng", "Eiffel Tower, in Paris", R"(["Paris", "the Eiffel Tower"])"), 2.0 / 3,
              1e-12);
  EXPECT_EQ(Score("longbook_qa_eng", "An apple a day!", R"(["apple day"])"), 1);
  EXPECT_EQ(Score("longbook_qa_eng", "Theatre", R"(["theatre"])"), 1);  // "the" only as a word
  EXPECT_EQ(Score("longbook_qa_eng", "nothing shared", R"(["apple"])"), 0);
  EXPECT_EQ(Score("longbook_qa_eng", "", R"(["apple"])"), 0);
}

TEST(InfBenchScore, ChineseQaIsCharacterF1WithoutPunctuationOrSpace) {
  EXPECT_EQ(Score("longbook_qa_chn", "北京。", R"(["北京"])"), 1);
  EXPECT_NEAR(Score("longbook_qa_chn", "在 北京！", R"(["北京"])"), 0.8, 1e-12);  // 在北京: p 2/3, r 1
  EXPECT_EQ(Score("longbook_qa_chn", "上海", R"(["北京"])"), 0);
}

TEST(InfBenchScore, SummaryIsRougeLsumAsRougeScoreComputesIt) {
  // Reference values from the rouge_score package (RougeScorer(["rougeLsum"]).score(ref, pred)).
  EXPECT_NEAR(RougeLsum("the cat lay on the mat", "the cat sat on the mat"), 0.8333333333333334, 1e-12);
  EXPECT_NEAR(RougeLsum("a c\nd x e", "a b c\nd e"), 0.8, 1e-12);
  EXPECT_NEAR(RougeLsum("cat sat mat on", "The Cat, sat!\n\nOn the mat."), 0.6, 1e-12);
  EXPECT_EQ(RougeLsum("", "a b"), 0);
  EXPECT_NEAR(Score("longbook_sum_eng", "the cat lay on the mat", R"(["the cat sat on the mat"])"),
              0.8333333333333334, 1e-12);
}

TEST(InfBenchScore, AGroundTruthTheTaskCannotScoreIsNamed) {
  EXPECT_FALSE(ScoreOne("passkey", "1", "not json").ok());
  EXPECT_FALSE(ScoreOne("passkey", "1", "[]").ok());
  EXPECT_FALSE(ScoreOne("math_calc", "1", "3").ok());
  EXPECT_FALSE(ScoreOne("code_debug", "A", R"(["f"])").ok());
  EXPECT_FALSE(ScoreOne("frobnicate", "1", "1").ok());
}

TEST(InfBenchPrompt, TruncationKeepsTheHeadAndTheTailAsTheBenchmarkDoes) {
  const std::string s = "0123456789";
  EXPECT_EQ(TruncateMiddle(s, 20), s);
  EXPECT_EQ(TruncateMiddle(s, 10), s);
  EXPECT_EQ(TruncateMiddle(s, 4), "0189");
  EXPECT_EQ(TruncateMiddle(s, 5), "01789");  // input[:5 // 2] + input[-5 // 2:] = first 2, last 3
  EXPECT_EQ(TruncateMiddle(std::vector<int>{1, 2, 3, 4, 5, 6, 7}, 3), (std::vector<int>{1, 6, 7}));
  EXPECT_EQ(TruncateMiddle(s, 0), "");
}

BenchSample Sample(const std::string& context, const std::string& input,
                   std::vector<std::string> options = {}) {
  BenchSample s;
  s.context = context;
  s.input = input;
  s.options = std::move(options);
  s.line = 3;
  return s;
}

TEST(InfBenchPrompt, EachFamilyFillsTheBenchmarksTemplates) {
  auto p = BuildPrompt("kvtier", "passkey", Sample("CTX ", "What is the pass key? The pass key is "));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, "CTX What is the pass key? The pass key is ");
  p = BuildPrompt("yarn-mistral", "passkey", Sample("CTX", "What is the pass key?"));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(
      *p,
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will "
      "quiz you about the important information there.\n\nCTX\n\nWhat is the pass key?\n\nThe pass key is");
  p = BuildPrompt("chatglm3", "passkey", Sample("CTX", "What is the pass key?"));  // yarn-mistral's
  ASSERT_TRUE(p.ok());
  EXPECT_NE(p->find("The pass key is"), std::string::npos);
  p = BuildPrompt("gpt4", "longbook_choice_eng", Sample("BOOK", "Where?", {"Rome", "Paris", "Oslo", "Bern"}));
  ASSERT_TRUE(p.ok());
  EXPECT_NE(p->find("BOOK\n\nQuestion: Where?\n\n"), std::string::npos) << *p;
  EXPECT_NE(p->find("\nA. Rome\nB. Paris\nC. Oslo\nD. Bern"), std::string::npos) << *p;
  // A context holding braces is not read as a template.
  p = BuildPrompt("gpt4", "kv_retrieval", Sample(R"({"{input}": "x"})", "Key?"));
  ASSERT_TRUE(p.ok());
  EXPECT_NE(p->find(R"({"{input}": "x"})"), std::string::npos) << *p;
}

TEST(InfBenchPrompt, CodeRunAndMathFindTakeTheirPartsFromTheInput) {
  auto p = BuildPrompt("yarn-mistral", "code_run", Sample("CODE", "Compute func_12(-3) for me"));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(
      *p,
      "There is a function called func_12 in the following Python code.\n\nCODE\n\nPlease compute the exact "
      "value of func_12(-3). The value of func_12(-3) is");
  p = BuildPrompt("gpt4", "math_find", Sample("[1, 5, 2]", "What is the largest number of the list?"));
  ASSERT_FALSE(p.ok());  // "The ..." is case-sensitive, as the benchmark's regex
  p = BuildPrompt("gpt4", "math_find", Sample("[1, 5, 2]", "The largest number of the list is"));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(
      *p,
      "What is the largest number in the following list?\n\n[1, 5, 2]\n\nThe largest number of the list is");
  auto bad = BuildPrompt("gpt4", "code_run", Sample("CODE", "no call here"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 3"), std::string::npos) << bad.status().ToString();
  bad = BuildPrompt("llama-9", "passkey", Sample("C", "I"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("kvtier | gpt4 | yarn-mistral"), std::string::npos);
}

// ---- task files --------------------------------------------------------------------------------

std::string Write(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.path() + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST(InfBenchTaskFile, ReadsEveryTaskOfTheOfficialSchema) {
  TempDir dir;
  const std::string choice_options = R"(["Rome", "Paris", "Oslo", "Bern"])";
  const std::map<std::string, std::string> lines = {
      {"passkey", R"({"id": 0, "context": "c", "input": "i", "answer": ["71432"], "options": []})"},
      {"number_string",
       R"({"id": 0, "context": "c", "input": "i", "answer": ["1234567890"], "options": []})"},
      {"kv_retrieval", R"({"id": 0, "context": "c", "input": "i", "answer": ["v-1"], "options": []})"},
      {"longdialogue_qa_eng", R"({"id": 0, "context": "c", "input": "", "answer": ["JOHN"], "options": []})"},
      {"longbook_sum_eng",
       R"({"id": 0, "context": "c", "input": "", "answer": ["a summary"], "options": []})"},
      {"longbook_choice_eng",
       R"({"id": 0, "context": "c", "input": "Where?", "answer": ["Paris"], "options": )" + choice_options +
           "}"},
      {"longbook_qa_eng", R"({"id": 0, "context": "c", "input": "q", "answer": ["a", "b"], "options": []})"},
      {"longbook_qa_chn", R"({"id": 0, "context": "书", "input": "问", "answer": ["北京"], "options": []})"},
      {"math_find",
       R"({"id": 0, "context": "[1]", "input": "The largest number of it", "answer": 1, "options": []})"},
      {"math_calc", R"({"id": 0, "context": "1 + 2", "input": "", "answer": [1, 3], "options": []})"},
      {"code_run", R"j({"id": 0, "context": "def", "input": "func_1(2)", "answer": 5, "options": []})j"},
      {"code_debug",
       R"({"id": "x-0", "context": "def", "input": "", "answer": "g", "options": ["f", "g", "h", "k"]})"},
  };
  for (const auto& [task, line] : lines) Write(dir, task + ".jsonl", line + "\n\n");
  Write(dir, "notes.jsonl", "not a task file\n");
  auto data = ReadTaskData(dir.path());
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  ASSERT_EQ(data->size(), 12u);
  for (size_t i = 0; i < data->size(); ++i) {
    const TaskFile& f = (*data)[i];
    EXPECT_EQ(f.task, TaskNames()[i]);
    ASSERT_EQ(f.samples.size(), 1u) << f.task;  // the blank line is skipped
    EXPECT_EQ(f.samples[0].line, 1);
    auto prompt = BuildPrompt("gpt4", f.task, f.samples[0]);
    EXPECT_TRUE(prompt.ok()) << f.task << ": " << prompt.status().ToString();
    EXPECT_TRUE(GroundTruthJson(f.task, f.samples[0]).ok()) << f.task;
  }
  EXPECT_EQ(*GroundTruthJson("longbook_choice_eng", (*data)[5].samples[0]), R"(["Paris","B"])");
  EXPECT_EQ(*GroundTruthJson("code_debug", (*data)[11].samples[0]), R"(["g","B"])");
  EXPECT_EQ((*data)[11].samples[0].id_json, R"("x-0")");
  // A single file, its task from its name.
  auto one = ReadTaskData(dir.path() + "/kv_retrieval.jsonl");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)[0].task, "kv_retrieval");
  auto named = ReadTaskFile(Write(dir, "passkey_128k.jsonl", lines.at("passkey") + "\n"));
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  EXPECT_EQ(named->task, "passkey");
}

TEST(InfBenchTaskFile, MalformedLinesAreNamedByFileLineAndField) {
  TempDir dir;
  const std::string good = R"({"id": 1, "context": "c", "input": "i", "answer": ["1"]})";
  struct Case {
    std::string task, text, expect;
  } cases[] = {
      {"passkey", good + "\n{\"id\": 2, \"context\": \"c\"", ":2: not a JSON object"},
      {"passkey", "[1, 2]", ":1: not a JSON object"},
      {"passkey", R"({"context": "c", "input": "i", "answer": ["1"]})", ":1: field 'id' is missing"},
      {"passkey", R"({"id": 1.5, "context": "c", "input": "i", "answer": ["1"]})", "field 'id' must be"},
      {"passkey", R"({"id": 1, "input": "i", "answer": ["1"]})", "field 'context' is missing"},
      {"passkey", R"({"id": 1, "context": 3, "input": "i", "answer": ["1"]})",
       "field 'context' must be a string"},
      {"passkey", R"({"id": 1, "context": "c", "input": "i"})", "field 'answer' is missing"},
      {"passkey", R"({"id": 1, "context": "c", "input": "i", "answer": []})",
       "field 'answer' is an empty list"},
      {"passkey", R"({"id": 1, "context": "c", "input": "i", "answer": {"a": 1}})", "field 'answer' must be"},
      {"math_calc", R"({"id": 1, "context": "c", "input": "", "answer": [1, "2"]})",
       "must hold integers only"},
      {"math_find", R"({"id": 1, "context": "c", "input": "", "answer": ["x"]})", "must be a number"},
      {"code_debug", R"({"id": 1, "context": "c", "input": "", "answer": "f", "options": ["f", "g"]})",
       "must hold the 4 choices"},
      {"code_debug",
       R"({"id": 1, "context": "c", "input": "", "answer": "z", "options": ["f", "g", "h", "k"]})",
       "is none of the 4 options"},
      {"passkey", R"({"id": 1, "context": "c", "input": "i", "answer": ["1"], "options": "x"})",
       "field 'options' must be a list of strings"},
      {"passkey", R"({"id": 1, "context": "c", "input": "i", "answer": ["1"], "max_new_tokens": 0})",
       "field 'max_new_tokens' must be"},
      {"passkey", "\n\n", "holds no samples"},
  };
  for (const Case& c : cases) {
    const std::string path = Write(dir, c.task + ".jsonl", c.text);
    auto f = ReadTaskFile(path);
    ASSERT_FALSE(f.ok()) << c.text;
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(f.status().message().find(c.expect), std::string::npos) << f.status().ToString();
    EXPECT_NE(f.status().message().find(path), std::string::npos) << f.status().ToString();
  }
  auto unnamed = ReadTaskFile(Write(dir, "data.jsonl", good));
  ASSERT_FALSE(unnamed.ok());
  EXPECT_NE(unnamed.status().message().find("name it <task>.jsonl"), std::string::npos);
  EXPECT_EQ(ReadTaskData(dir.path() + "/missing").status().code(), StatusCode::kNotFound);
  TempDir empty;
  EXPECT_EQ(ReadTaskData(empty.path()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(ReadTaskData(dir.path() + "/").status().code(), StatusCode::kInvalidArgument)
      << "a folder whose task files are malformed is refused, not skipped";
}

TEST(InfBenchTaskFile, WrittenFilesReadBackTheSame) {
  TempDir dir;
  BenchSample s = Sample("ctx \x01\xff", "q?");
  s.id_json = "7";
  s.answer_json = R"(["12345"])";
  s.max_new_tokens = 5;
  const std::string path = dir.path() + "/passkey.jsonl";
  ASSERT_TRUE(WriteTaskFile(path, {s, s}).ok());
  auto f = ReadTaskFile(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->samples.size(), 2u);
  EXPECT_EQ(f->samples[1].line, 2);
  EXPECT_EQ(f->samples[0].id_json, "7");
  EXPECT_EQ(f->samples[0].input, "q?");
  EXPECT_EQ(f->samples[0].max_new_tokens, 5);
  EXPECT_EQ(f->samples[0].answer_json, R"(["12345"])");
}

// ---- predictions ------------------------------------------------------------------------------

TEST(InfBenchPredictions, ReopeningResumesAndDropsALineCutShortByAKill) {
  TempDir dir;
  const std::string path = dir.path() + "/kvtier/preds_passkey.jsonl";
  {
    auto f = PredictionsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    ASSERT_TRUE((*f)->Append({"0", "71432", R"(["71432"])"}).ok());
    ASSERT_TRUE((*f)->Append({"\"b-1\"", "garbage \xff", R"(["12345"])"}).ok());
  }
  // A kill in the middle of the third line.
  { std::ofstream(path, std::ios::app) << R"({"id": 2, "predic)"; }
  auto f = PredictionsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->dropped_partial_lines(), 1);
  ASSERT_EQ((*f)->predictions().size(), 2u);
  ASSERT_NE((*f)->Find("\"b-1\""), nullptr);
  EXPECT_EQ((*f)->Find("\"b-1\"")->ground_truth_json, R"(["12345"])");
  EXPECT_EQ((*f)->Find("2"), nullptr);
  ASSERT_TRUE((*f)->Append({"2", "33333", R"(["33333"])"}).ok());
  f->reset();
  const std::string text = test::ReadAll(path);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3) << text;
  EXPECT_NE(text.find(R"({"ground_truth":["33333"],"id":2,"prediction":"33333"})"), std::string::npos)
      << text;
  // A complete last line without its newline is kept, and the next one starts on a line of its own.
  { std::ofstream(path, std::ios::app) << R"({"id": 3, "prediction": "x", "ground_truth": ["y"]})"; }
  f = PredictionsFile::Open(path);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->predictions().size(), 4u);
  ASSERT_TRUE((*f)->Append({"4", "z", R"(["z"])"}).ok());
  f->reset();
  f = PredictionsFile::Open(path);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->predictions().size(), 5u);
  EXPECT_EQ((*f)->dropped_partial_lines(), 0);
}

TEST(InfBenchPredictions, ADamagedLineInTheMiddleIsNamed) {
  TempDir dir;
  const std::string path = dir.path() + "/preds_passkey.jsonl";
  std::ofstream(path) << "{\"id\": 0, \"prediction\": \"1\", \"ground_truth\": [\"1\"]}\nnot json\n"
                      << "{\"id\": 1, \"prediction\": \"1\", \"ground_truth\": [\"1\"]}\n";
  auto f = PredictionsFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find(path + ":2: not a prediction"), std::string::npos)
      << f.status().ToString();
}

}  // namespace
}  // namespace kvtier::infbench
