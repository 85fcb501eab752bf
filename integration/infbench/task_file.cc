#include "integration/infbench/task_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "store/file_bytes.h"

namespace kvtier::infbench {
namespace {

using nlohmann::json;

const std::vector<std::string> kTasks = {
    "passkey",          "number_string",       "kv_retrieval",    "longdialogue_qa_eng",
    "longbook_sum_eng", "longbook_choice_eng", "longbook_qa_eng", "longbook_qa_chn",
    "math_find",        "math_calc",           "code_run",        "code_debug",
};

std::string Where(const std::string& path, int line) { return path + ":" + std::to_string(line); }

// An answer value: a string or a number.
bool IsScalar(const json& v) { return v.is_string() || v.is_number(); }

// What each task's scorer needs of its answer (the benchmark's compute_scores.py).
Status CheckAnswer(const std::string& task, const json& a, const std::string& at) {
  auto bad = [&](const std::string& what) {
    return InvalidArgument(at + ": field 'answer' " + what + " (task " + task + ", got " +
                           a.dump(-1, ' ', false, json::error_handler_t::replace).substr(0, 80) + ")");
  };
  const bool list = a.is_array();
  if (list && a.empty()) return bad("is an empty list");
  if (!list && !IsScalar(a)) return bad("must be a string, a number or a list of them");
  if (list)
    for (const json& v : a)
      if (!IsScalar(v)) return bad("must be a string, a number or a list of them");
  const json& first = list ? a[0] : a;
  if (task == "math_calc") {
    if (!list) return bad("must be the list of the expression's intermediate values");
    for (const json& v : a)
      if (!v.is_number_integer()) return bad("must hold integers only");
  }
  if (task == "math_find" && !first.is_number()) return bad("must be a number");
  return Status::Ok();
}

Result<BenchSample> ParseLine(const std::string& task, const std::string& text, const std::string& at) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    return InvalidArgument(at + ": not a JSON object (" + std::string(e.what()) + ")");
  }
  if (!j.is_object()) return InvalidArgument(at + ": not a JSON object");
  BenchSample s;
  auto field = [&](const char* name) -> const json* {
    auto it = j.find(name);
    return it == j.end() ? nullptr : &*it;
  };
  const json* id = field("id");
  if (id == nullptr) return InvalidArgument(at + ": field 'id' is missing");
  if (!id->is_string() && !id->is_number_integer())
    return InvalidArgument(at + ": field 'id' must be an integer or a string");
  s.id_json = id->dump();
  for (const char* name : {"context", "input"}) {
    const json* v = field(name);
    if (v == nullptr) return InvalidArgument(at + ": field '" + name + "' is missing");
    if (!v->is_string()) return InvalidArgument(at + ": field '" + name + "' must be a string");
    (std::string(name) == "context" ? s.context : s.input) = v->get<std::string>();
  }
  const json* answer = field("answer");
  if (answer == nullptr) return InvalidArgument(at + ": field 'answer' is missing");
  KVTIER_RETURN_IF_ERROR(CheckAnswer(task, *answer, at));
  s.answer_json = answer->dump(-1, ' ', false, json::error_handler_t::replace);
  if (const json* opts = field("options"); opts != nullptr && !opts->is_null()) {
    if (!opts->is_array()) return InvalidArgument(at + ": field 'options' must be a list of strings");
    for (const json& o : *opts) {
      if (!o.is_string()) return InvalidArgument(at + ": field 'options' must be a list of strings");
      s.options.push_back(o.get<std::string>());
    }
  }
  if (task == "longbook_choice_eng" || task == "code_debug") {
    if (s.options.size() != 4)
      return InvalidArgument(at + ": field 'options' must hold the 4 choices of task " + task + " (got " +
                             std::to_string(s.options.size()) + ")");
    auto r = GroundTruthJson(task, s);
    if (!r.ok()) return InvalidArgument(at + ": " + r.status().message());
  }
  if (const json* m = field("max_new_tokens"); m != nullptr) {
    if (!m->is_number_integer() || m->get<int64_t>() < 1 || m->get<int64_t>() > (1 << 20))
      return InvalidArgument(at + ": field 'max_new_tokens' must be an integer in [1, 1048576]");
    s.max_new_tokens = m->get<int>();
  }
  return s;
}

// The task a file's name says: its stem, or the longest task name it starts with followed by
// '.', '_' or '-'.
std::string TaskOfFileName(const std::string& path) {
  const std::string name = std::filesystem::path(path).filename().string();
  std::string best;
  for (const std::string& t : kTasks)
    if (name.size() > t.size() && name.compare(0, t.size(), t) == 0 &&
        (name[t.size()] == '.' || name[t.size()] == '_' || name[t.size()] == '-') && t.size() > best.size())
      best = t;
  return best;
}

}  // namespace

const std::vector<std::string>& TaskNames() { return kTasks; }

Status CheckTaskName(const std::string& task) {
  if (std::find(kTasks.begin(), kTasks.end(), task) != kTasks.end()) return Status::Ok();
  std::string all;
  for (const std::string& t : kTasks) all += (all.empty() ? "" : " | ") + t;
  return InvalidArgument("unknown ∞-Bench task '" + task + "' (" + all + ")");
}

Result<TaskFile> ReadTaskFile(const std::string& path, const std::string& task) {
  TaskFile f;
  f.path = path;
  f.task = task.empty() ? TaskOfFileName(path) : task;
  if (f.task.empty())
    return InvalidArgument("'" + path +
                           "': its name does not say which ∞-Bench task it holds (name it <task>.jsonl, "
                           "e.g. passkey.jsonl)");
  KVTIER_RETURN_IF_ERROR(CheckTaskName(f.task));
  KVTIER_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(path, "task file"));
  int line = 0;
  size_t pos = 0;
  while (pos < bytes.size()) {
    size_t end = bytes.find('\n', pos);
    if (end == std::string::npos) end = bytes.size();
    std::string text = bytes.substr(pos, end - pos);
    pos = end + 1;
    ++line;
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    KVTIER_ASSIGN_OR_RETURN(BenchSample s, ParseLine(f.task, text, Where(path, line)));
    s.line = line;
    f.samples.push_back(std::move(s));
  }
  if (f.samples.empty()) return InvalidArgument("'" + path + "': holds no samples");
  return f;
}

Result<std::vector<TaskFile>> ReadTaskData(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) return IOError("'" + path + "': " + ec.message());
  if (!fs::exists(st)) return NotFound("∞-Bench data '" + path + "' does not exist");
  std::vector<TaskFile> out;
  if (!fs::is_directory(st)) {
    KVTIER_ASSIGN_OR_RETURN(TaskFile f, ReadTaskFile(path));
    out.push_back(std::move(f));
    return out;
  }
  for (const std::string& t : kTasks) {
    const std::string file = (fs::path(path) / (t + ".jsonl")).string();
    if (!fs::exists(file, ec)) continue;
    KVTIER_ASSIGN_OR_RETURN(TaskFile f, ReadTaskFile(file, t));
    out.push_back(std::move(f));
  }
  if (out.empty())
    return NotFound(
        "'" + path +
        "' holds no ∞-Bench task file (looked for <task>.jsonl, task one of passkey, "
        "number_string, kv_retrieval, longdialogue_qa_eng, longbook_sum_eng, longbook_choice_eng, "
        "longbook_qa_eng, longbook_qa_chn, math_find, math_calc, code_run, code_debug)");
  return out;
}

Status WriteTaskFile(const std::string& path, const std::vector<BenchSample>& samples) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return IOError("cannot write task file '" + path + "'");
  for (const BenchSample& s : samples) {
    json j;
    j["id"] = json::parse(s.id_json);
    j["context"] = s.context;
    j["input"] = s.input;
    j["answer"] = json::parse(s.answer_json);
    j["options"] = s.options;
    if (s.max_new_tokens > 0) j["max_new_tokens"] = s.max_new_tokens;
    f << j.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
  }
  f.flush();
  if (!f) return IOError("writing task file '" + path + "' failed");
  return Status::Ok();
}

Result<std::string> GroundTruthJson(const std::string& task, const BenchSample& s) {
  if (task != "longbook_choice_eng" && task != "code_debug") return s.answer_json;
  // [option text, option letter]: the answer is the text of one option, or already the pair.
  const json a = json::parse(s.answer_json);
  auto letter_of = [&](const std::string& text) -> Result<std::string> {
    auto it = std::find(s.options.begin(), s.options.end(), text);
    if (it == s.options.end())
      return InvalidArgument("field 'answer' ('" + text.substr(0, 60) + "') is none of the 4 options");
    return std::string(1, static_cast<char>('A' + (it - s.options.begin())));
  };
  std::string text;
  if (a.is_string()) {
    text = a.get<std::string>();
  } else if (a.is_array() && a.size() == 1 && a[0].is_string()) {
    text = a[0].get<std::string>();
  } else if (a.is_array() && a.size() == 2 && a[0].is_string() && a[1].is_string() &&
             std::string("ABCD").find(a[1].get<std::string>()) != std::string::npos &&
             a[1].get<std::string>().size() == 1) {
    return s.answer_json;
  } else {
    return InvalidArgument("field 'answer' must be one option's text (or [text, letter])");
  }
  KVTIER_ASSIGN_OR_RETURN(std::string letter, letter_of(text));
  return json::array({text, letter}).dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace kvtier::infbench
