// ∞-Bench's prompts and truncation (the benchmark's src/prompt.py and eval_utils.py).
//
// A template family is the set of twelve per-task templates the benchmark uses for one kind
// of model: `gpt4` (chat models told what to do: the benchmark's GPT-4 prompts), `yarn-mistral`
// (base models that complete the text: "... The pass key is"; the benchmark also uses it for
// yi-6b-200k, yi-34b-200k and chatglm3, accepted as aliases), and `kvtier` (the context and
// the input as they are, one after the other: the format kvtier-tiny was trained on, which
// kvtier's own generator writes). Templates fill {context}, {input}, {question} (= the input),
// {OPTION_A..D}, {func} and {func_call} (code_run: from the input's func_N(x)) and {prefix}
// (math_find: "What is <the target> in the following list?" from the input's "The ... of").
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "integration/infbench/task_file.h"

namespace kvtier::infbench {

/// The families, first the default of `kvtier infinite --data` (kvtier).
const std::vector<std::string>& TemplateFamilies();

/// OK for one of TemplateFamilies() or an alias; else InvalidArgument listing them.
Status CheckTemplateFamily(const std::string& family);

/// The prompt of one sample (before truncation). Unknown family -> InvalidArgument listing
/// them; an input the task's template needs a part of and lacks (code_run's func_N(x),
/// math_find's "The ... of") -> InvalidArgument naming the sample's line.
Result<std::string> BuildPrompt(const std::string& family, const std::string& task, const BenchSample& s);

/// The benchmark's truncation: a sequence longer than `max_len` keeps its first max_len / 2
/// and its last max_len - max_len / 2 elements (eval_utils.truncate_input, manner "middle";
/// Python's input[:n // 2] + input[-n // 2:]). Counted in the model's tokens.
template <typename Seq>
Seq TruncateMiddle(const Seq& in, size_t max_len) {
  if (in.size() <= max_len) return in;
  Seq out(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(max_len / 2));
  out.insert(out.end(), in.end() - static_cast<std::ptrdiff_t>(max_len - max_len / 2), in.end());
  return out;
}

/// The benchmark's generation budget per task, in the model's tokens
/// (eval_utils.DATA_NAME_TO_MAX_NEW_TOKENS).
int DefaultMaxNewTokens(const std::string& task);

}  // namespace kvtier::infbench
