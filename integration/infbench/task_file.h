// ∞-Bench's task files (InfiniteBench, Zhang et al. 2024, "∞Bench: Extending Long Context
// Evaluation Beyond 100K Tokens"): the twelve tasks of the benchmark's data
// (`xinrongzhang2022/InfiniteBench`), one JSON object per line:
//
//   {"id": 0, "context": "...", "input": "...", "answer": ["71432"], "options": []}
//
// `id` is a number or a string; `context` and `input` are strings (`input` may be empty);
// `answer` is a string, a number, or a non-empty list of them; `options` (a list of strings)
// holds the four choices of longbook_choice_eng and code_debug, whose answer must be one of
// them. A line may also carry `max_new_tokens` (a positive integer): the generation budget of
// that sample, which kvtier's own generator writes (its answers have a fixed length in the
// model's byte tokens); without it the task's budget applies (DefaultMaxNewTokens). Anything
// else malformed is InvalidArgument naming the file, the line and the field.
#pragma once

#include <string>
#include <vector>

#include "store/status.h"

namespace kvtier::infbench {

/// The twelve tasks, in the benchmark's order (its ALL_TASKS).
const std::vector<std::string>& TaskNames();
/// OK for one of TaskNames(); else InvalidArgument listing them.
Status CheckTaskName(const std::string& task);

struct BenchSample {
  std::string id_json;  ///< the id as the file writes it: 3 or "a-3"
  std::string context, input;
  std::string answer_json;  ///< the answer as the file writes it (a JSON value)
  std::vector<std::string> options;
  int max_new_tokens = 0;  ///< 0: the task's budget
  int line = 0;            ///< 1-based line in its file
};

struct TaskFile {
  std::string task, path;
  std::vector<BenchSample> samples;
};

/// Reads one task file. `task` empty: the file's name says which (`passkey.jsonl`, or any
/// name that starts with a task's name followed by '.', '_' or '-', longest first).
/// Blank lines are skipped, as the benchmark's reader does.
Result<TaskFile> ReadTaskFile(const std::string& path, const std::string& task = "");

/// A task file, or a folder holding task files named after their tasks (`<task>.jsonl`);
/// a folder with none of them is NotFound listing the names looked for.
Result<std::vector<TaskFile>> ReadTaskData(const std::string& path);

/// Writes samples as a task file (one line each, the fields above), replacing `path`.
Status WriteTaskFile(const std::string& path, const std::vector<BenchSample>& samples);

/// What the benchmark's scorer compares a prediction with (its get_answer): for the choice
/// tasks [option text, option letter], for the others the answer as it is. JSON text.
Result<std::string> GroundTruthJson(const std::string& task, const BenchSample& s);

}  // namespace kvtier::infbench
