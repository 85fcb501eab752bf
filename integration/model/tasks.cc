#include "integration/model/tasks.h"

#include <cstdio>
#include <set>
#include <vector>

namespace kvtier::model {
namespace {

// ∞-Bench-style task prompts (see tasks.h). The byte formats are the Python trainer's (models/tasks.py,
// documented in models/README.md "Task formats"), byte for byte, so a model trained there is evaluated on the
// prompts it learnt. The random draws here come from std::mt19937_64, so the samples themselves are not the
// Python ones.

const std::string kIntro =
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n";
const std::string kFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n";
const std::string kKvIntro =
    "Below is a list of keys and values. Find the value of the key I will ask about.\n";

// The answer's first copy inside the needle.
void FindAnswer(Sample* s) {
  const size_t at = s->prompt.find(s->answer, static_cast<size_t>(s->needle_begin));
  s->answer_begin = at == std::string::npos ? s->needle_begin : static_cast<int64_t>(at);
  s->answer_end =
      at == std::string::npos ? s->needle_end : s->answer_begin + static_cast<int64_t>(s->answer.size());
}

std::string RandomChars(std::mt19937_64& rng, const char* alphabet, int n) {
  const int size = static_cast<int>(std::char_traits<char>::length(alphabet));
  std::uniform_int_distribution<int> pick(0, size - 1);
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(alphabet[pick(rng)]);
  return s;
}

// kIntro + k filler lines + needle + (n - k) filler lines + question, where n is the largest
// number of whole filler lines keeping prompt + answer within `length`, k uniform in 0..n.
Result<Sample> Haystack(const std::string& task, const std::string& needle, const std::string& question,
                        const std::string& answer, int64_t length, std::mt19937_64& rng) {
  const int64_t fixed = static_cast<int64_t>(kIntro.size() + needle.size() + question.size() + answer.size());
  if (fixed > length)
    return InvalidArgument("context " + std::to_string(length) + " is too short for task " + task +
                           " (needs >= " + std::to_string(fixed) + " bytes)");
  const int64_t n = (length - fixed) / static_cast<int64_t>(kFiller.size());
  const int64_t k = std::uniform_int_distribution<int64_t>(0, n)(rng);
  Sample s;
  s.prompt.reserve(static_cast<size_t>(length));
  s.prompt = kIntro;
  for (int64_t i = 0; i < k; ++i) s.prompt += kFiller;
  s.needle_begin = static_cast<int64_t>(s.prompt.size());
  s.prompt += needle;
  s.needle_end = static_cast<int64_t>(s.prompt.size());
  for (int64_t i = k; i < n; ++i) s.prompt += kFiller;
  s.question_begin = static_cast<int64_t>(s.prompt.size());
  s.prompt += question;
  s.answer = answer;
  FindAnswer(&s);
  return s;
}

}  // namespace

Status CheckTask(const std::string& task) {
  if (task == "passkey" || task == "number_string" || task == "kv_retrieval") return Status::Ok();
  return InvalidArgument("unknown task '" + task + "' (passkey | number_string | kv_retrieval)");
}

std::mt19937_64 SampleRng(int64_t seed, int64_t context) {
  return std::mt19937_64(static_cast<uint64_t>(seed) * 1000003ull + static_cast<uint64_t>(context));
}

std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) {
    if (ch >= 32 && ch < 127 && ch != '"' && ch != '\\') {
      out.push_back(static_cast<char>(ch));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", ch);
      out += buf;
    }
  }
  return out;
}

Result<Sample> MakeSample(const std::string& task, int64_t length, std::mt19937_64& rng) {
  if (task == "passkey") {
    const std::string key = RandomChars(rng, "0123456789", 5);
    return Haystack(task, "The pass key is " + key + ". Remember it. " + key + " is the pass key.\n",
                    "What is the pass key? The pass key is ", key, length, rng);
  }
  if (task == "number_string") {
    const std::string seq = RandomChars(rng, "0123456789", 10);
    return Haystack(task,
                    "The sequence of digits is " + seq + ". Remember it. " + seq + " is the sequence.\n",
                    "What is the sequence of digits? The sequence of digits is ", seq, length, rng);
  }
  if (task == "kv_retrieval") {
    // kKvIntro + N lines "KEY: VALUE\n" (distinct 8-char lowercase hex keys, 8-char hex values; N as
    // large as fits, at least 1) + the question about one uniformly chosen key.
    const int64_t line_len = 8 + 2 + 8 + 1;
    const int64_t q_len = static_cast<int64_t>(std::string("What is the value of key ").size() + 8 +
                                               std::string("? The value is ").size() + 8);
    const int64_t n = (length - static_cast<int64_t>(kKvIntro.size()) - q_len) / line_len;
    if (n < 1)
      return InvalidArgument("context " + std::to_string(length) +
                             " is too short for task kv_retrieval (needs >= " +
                             std::to_string(kKvIntro.size() + q_len + line_len) + " bytes)");
    std::vector<std::string> keys, values;
    std::set<std::string> seen;
    while (static_cast<int64_t>(keys.size()) < n) {
      std::string k = RandomChars(rng, "0123456789abcdef", 8);
      if (seen.insert(k).second) keys.push_back(std::move(k));
    }
    for (int64_t i = 0; i < n; ++i) values.push_back(RandomChars(rng, "0123456789abcdef", 8));
    const size_t asked = static_cast<size_t>(std::uniform_int_distribution<int64_t>(0, n - 1)(rng));
    Sample s;
    s.prompt = kKvIntro;
    for (int64_t i = 0; i < n; ++i) {
      if (static_cast<size_t>(i) == asked) s.needle_begin = static_cast<int64_t>(s.prompt.size());
      s.prompt += keys[i] + ": " + values[i] + "\n";
      if (static_cast<size_t>(i) == asked) s.needle_end = static_cast<int64_t>(s.prompt.size());
    }
    s.question_begin = static_cast<int64_t>(s.prompt.size());
    s.prompt += "What is the value of key " + keys[asked] + "? The value is ";
    s.answer = values[asked];
    FindAnswer(&s);
    return s;
  }
  return CheckTask(task);
}

}  // namespace kvtier::model
