#include "integration/infbench/prompt.h"

#include <algorithm>
#include <map>
#include <regex>

namespace kvtier::infbench {
namespace {

using Templates = std::map<std::string, std::string>;

// The benchmark's templates, verbatim (src/prompt.py: gpt4_templates, yarn_mistral_templates).
const Templates kGpt4 = {
    {"passkey",
     "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will "
     "quiz "
     "you about the important information there.\n\n{context}\n\n{input}"},
    {"number_string",
     "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the "
     "important information there.\n\n{context}\n\n{input}"},
    {"kv_retrieval",
     "Extract the value corresponding to the specified key in the JSON object "
     "below.\n\n{context}\n\n{input}"},
    {"longbook_qa_eng",
     "Read the book below and answer a question.\n\n{context}\n\nQuestion: {question}\n\nBe very concise."},
    {"longbook_choice_eng",
     "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n\nOnly one of the "
     "following "
     "options is correct, tell me the answer using one single letter (A, B, C, or D). Don't say anything "
     "else.\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"},
    {"longbook_sum_eng", "Summarize the following book.\n\n{context}"},
    {"longbook_qa_chn",
     "\u8bf7\u6839\u636e\u4ee5\u4e0b\u4e66\u7c4d\u56de\u7b54\u6211\u7684\u95ee\u9898\u3002\n\n{context}\n\n"
     "\u95ee\u9898\uff1a{question}\n\u8bf7\u5c3d\u91cf\u7b80\u77ed\u5730\u56de\u7b54\u3002"},
    {"math_find", "{prefix}\n\n{context}\n\n{input}"},
    // The benchmark sends GPT-4 the bare expression with a system message and an example
    // exchange (eval_utils.create_msgs); as one prompt that is the context alone.
    {"math_calc", "{context}"},
    {"code_run",
     "Following is a set of Python functions. There is a function called named "
     "{func}.\n\n{context}\n\nPlease "
     "give me the exact number of the return value of {func_call}. Be concise. Your response must end with "
     "the "
     "final returned value."},
    {"code_debug",
     "There is ONLY ONE function in the large project that is deliberately made to include an obvious error. "
     "Please find the function that contains the most obvious errors. I will give you four options to narrow "
     "your scope. You can inspect the options and think. Eventually, tell me the answer using one single "
     "letter "
     "(A, B, C, or D).\n\n{context}\n\nWhich funtion has deliberate error?\nA. {OPTION_A}\nB. {OPTION_B}\nC. "
     "{OPTION_C}\nD. {OPTION_D}\n\nYou should first find the functions in the options. Repeat their content, "
     "inspect through code, and at last give me your answer for the function that has the deliberate and "
     "obvious error in A, B, C, or D."},
    {"longdialogue_qa_eng",
     "Below is a dialogue script where one random occurrence of a character name is replaced with "
     "\"$$MASK$$\", and you should try to guess who that character is.\n\nThe "
     "dialogue:\n\n---\n\n{context}\n\n"
     "---\n\nEnd of dialogue.\n\nWhich character is most likely \"$$MASK$$\"? Just say the name used by the "
     "scriptwriter (before the colon marks) of one single character and nothing else."},
};

const Templates kYarnMistral = {
    {"passkey",
     "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will "
     "quiz "
     "you about the important information there.\n\n{context}\n\n{input}\n\nThe pass key is"},
    {"number_string",
     "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the "
     "important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is"},
    {"kv_retrieval",
     "Extract the value corresponding to the specified key in the JSON object "
     "below.\n\n{context}\n\n{input}"},
    {"longbook_sum_eng", "Summarize the book below.\n\n{context}\n\nSummary:"},
    {"longbook_choice_eng",
     "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\nB. "
     "{OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is"},
    {"longbook_qa_eng",
     "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\nQuestion: "
     "{question}\nAnswer:"},
    {"longbook_qa_chn",
     "\u9605\u8bfb\u4ee5\u4e0b\u4e66\u7c4d\u7136\u540e\u56de\u7b54\u95ee\u9898\u3002\n\n{context}\n\n"
     "\u95ee\u9898\uff1a{question}\n\u7b54\u6848\uff1a"},
    {"math_find", "{prefix}\n\n{context}\n\n{input}"},
    {"math_calc",
     "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, "
     "8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:"},
    {"code_run",
     "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the "
     "exact "
     "value of {func_call}. The value of {func_call} is"},
    {"code_debug",
     "Following is a Python code where exactly one of the functions/methods has a deliberate error that "
     "makes "
     "it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe "
     "correct option is:"},
    {"longdialogue_qa_eng",
     "Below is a dialogue script where one random occurrence of a character name is replaced with "
     "\"$$MASK$$\", and you should try to guess who that character is.\n\n{context}\n\nThe name that has "
     "been "
     "replaced with $$MASK$$ is likely"},
};

const std::vector<std::string> kFamilies = {"kvtier", "gpt4", "yarn-mistral"};

// Replaces every {name} of `tpl` by its value; the values are not scanned again.
std::string Fill(const std::string& tpl, const std::map<std::string, std::string>& values) {
  std::string out;
  size_t i = 0;
  while (i < tpl.size()) {
    if (tpl[i] == '{') {
      const size_t close = tpl.find('}', i);
      if (close != std::string::npos) {
        auto it = values.find(tpl.substr(i + 1, close - i - 1));
        if (it != values.end()) {
          out += it->second;
          i = close + 1;
          continue;
        }
      }
    }
    out.push_back(tpl[i++]);
  }
  return out;
}

// The family an alias stands for (the benchmark's MODEL_TO_PROMPT_TEMPLATE), else `family`.
std::string Canonical(const std::string& family) {
  return family == "yi-6b-200k" || family == "yi-34b-200k" || family == "chatglm3" ? "yarn-mistral" : family;
}

}  // namespace

const std::vector<std::string>& TemplateFamilies() { return kFamilies; }

Status CheckTemplateFamily(const std::string& family) {
  const std::string f = Canonical(family);
  if (std::find(kFamilies.begin(), kFamilies.end(), f) != kFamilies.end()) return Status::Ok();
  return InvalidArgument("unknown ∞-Bench template family '" + family +
                         "' (kvtier | gpt4 | yarn-mistral; yi-6b-200k, yi-34b-200k and chatglm3 use "
                         "yarn-mistral's)");
}

Result<std::string> BuildPrompt(const std::string& family, const std::string& task, const BenchSample& s) {
  KVTIER_RETURN_IF_ERROR(CheckTaskName(task));
  KVTIER_RETURN_IF_ERROR(CheckTemplateFamily(family));
  const std::string f = Canonical(family);
  if (f == "kvtier") return s.context + s.input;
  const Templates* templates = f == "gpt4" ? &kGpt4 : &kYarnMistral;
  std::map<std::string, std::string> v = {{"context", s.context}, {"input", s.input}, {"question", s.input}};
  if (s.options.size() == 4)
    for (int i = 0; i < 4; ++i) v[std::string("OPTION_") + static_cast<char>('A' + i)] = s.options[i];
  const std::string at = "line " + std::to_string(s.line) + " of task " + task;
  if (task == "code_run") {
    std::smatch m;
    static const std::regex call(R"(func_[0-9]+\(-?[0-9]+\))");
    if (!std::regex_search(s.input, m, call))
      return InvalidArgument(at + ": field 'input' names no call func_N(x) for the code_run prompt");
    v["func_call"] = m.str(0);
    v["func"] = m.str(0).substr(0, m.str(0).find('('));
  }
  if (task == "math_find") {
    // The benchmark's re.findall(r"The .+ of", input)[0].lower()[:-3]: greedy, up to the last
    // " of" of the line.
    std::smatch m;
    static const std::regex target("The .+ of");
    if (!std::regex_search(s.input, m, target))
      return InvalidArgument(at + ": field 'input' holds no \"The ... of\" naming the number to find");
    std::string t = m.str(0);
    for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    v["prefix"] = "What is " + t.substr(0, t.size() - 3) + " in the following list?";
  }
  return Fill(templates->at(task), v);
}

int DefaultMaxNewTokens(const std::string& task) {
  static const std::map<std::string, int> kBudget = {
      {"passkey", 6},
      {"number_string", 12},
      {"kv_retrieval", 50},
      {"longbook_sum_eng", 1200},
      {"longbook_choice_eng", 40},
      {"longbook_qa_eng", 40},
      {"longbook_qa_chn", 40},
      {"longdialogue_qa_eng", 40},
      {"math_find", 3},
      {"math_calc", 30000},
      {"code_run", 5},
      {"code_debug", 5},
  };
  auto it = kBudget.find(task);
  return it == kBudget.end() ? 0 : it->second;
}

}  // namespace kvtier::infbench
