// ∞-Bench-style retrieval prompts for the kvtier-llama model: passkey,
// number_string and kv_retrieval, in the byte formats the Python trainer uses
// (models/tasks.py; models/README.md "Task formats").
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "store/status.h"

namespace kvtier::model {

struct Sample {
  std::string prompt, answer;
  // Byte (= token) range of the prompt that holds the answer: the needle line, or the asked
  // key/value line. The needle oracle attends exactly the chunks over it. answer_begin/end:
  // the answer's first copy inside it, whose chunks needle recall asks about.
  int64_t needle_begin = 0, needle_end = 0, answer_begin = 0, answer_end = 0;
  // Where the question starts: prompt[0, question_begin) is the context, the rest the input
  // (the ∞-Bench task file schema, integration/infbench/task_file.h).
  int64_t question_begin = 0;
};

/// OK for "passkey" | "number_string" | "kv_retrieval", else InvalidArgument naming them.
Status CheckTask(const std::string& task);

/// The generator of the samples at one (seed, context): `kvtier infinite` draws its samples
/// from it in order, and `kvtier trace` records the first of them.
std::mt19937_64 SampleRng(int64_t seed, int64_t context);

/// Model output for printing: printable ASCII as is, other bytes (and '"', '\\') as \xNN
/// (an untrained model emits any byte).
std::string Printable(const std::string& s);

/// One prompt of `length` bytes (prompt + answer) for `task`, drawn from `rng`. InvalidArgument
/// for an unknown task or a length too short for it (the message says the minimum).
Result<Sample> MakeSample(const std::string& task, int64_t length, std::mt19937_64& rng);

}  // namespace kvtier::model
