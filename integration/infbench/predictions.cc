#include "integration/infbench/predictions.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "store/file_bytes.h"

namespace kvtier::infbench {

using nlohmann::json;

Result<std::unique_ptr<PredictionsFile>> PredictionsFile::Open(const std::string& path) {
  namespace fs = std::filesystem;
  std::unique_ptr<PredictionsFile> f(new PredictionsFile());
  f->path_ = path;
  std::error_code ec;
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) return IOError("cannot create the folder of predictions file '" + path + "': " + ec.message());
  }
  std::string bytes;
  if (fs::exists(path, ec)) {
    KVTIER_ASSIGN_OR_RETURN(bytes, ReadFileBytes(path, "predictions file"));
  }
  size_t pos = 0, whole = 0;   // whole: bytes up to the end of the last line kept
  bool needs_newline = false;  // the last line kept has no newline yet
  int line = 0;
  while (pos < bytes.size()) {
    const size_t nl = bytes.find('\n', pos);
    const bool last = nl == std::string::npos;
    const size_t end = last ? bytes.size() : nl;
    const std::string text = bytes.substr(pos, end - pos);
    ++line;
    json j;
    bool parsed = true;
    try {
      j = json::parse(text);
    } catch (const json::parse_error&) {
      parsed = false;
    }
    if (!parsed || !j.is_object() || !j.contains("id") || !j.contains("prediction") ||
        !j.contains("ground_truth") || !j["prediction"].is_string()) {
      if (text.find_first_not_of(" \t\r") == std::string::npos) {
        pos = end + 1;
        if (!last) whole = pos;
        continue;
      }
      if (last) {  // cut short by a kill: dropped, and the file cut back to the last whole line
        f->dropped_ = 1;
        break;
      }
      return InvalidArgument(path + ":" + std::to_string(line) +
                             ": not a prediction ({\"id\", \"prediction\", \"ground_truth\"})");
    }
    Prediction p{j["id"].dump(), j["prediction"].get<std::string>(),
                 j["ground_truth"].dump(-1, ' ', false, json::error_handler_t::replace)};
    f->by_id_[p.id_json] = f->predictions_.size();
    f->predictions_.push_back(std::move(p));
    whole = last ? end : end + 1;
    needs_newline = last;
    pos = end + 1;
  }
  if (whole < bytes.size()) {
    fs::resize_file(path, whole, ec);
    if (ec)
      return IOError("cannot cut predictions file '" + path +
                     "' back to its last whole line: " + ec.message());
  }
  f->file_ = std::fopen(path.c_str(), "ab");
  if (f->file_ == nullptr) return IOError("cannot open predictions file '" + path + "' for appending");
  if (needs_newline && (std::fputc('\n', f->file_) == EOF || std::fflush(f->file_) != 0))
    return IOError("cannot write predictions file '" + path + "'");
  return f;
}

PredictionsFile::~PredictionsFile() {
  if (file_ != nullptr) std::fclose(file_);
}

const Prediction* PredictionsFile::Find(const std::string& id_json) const {
  auto it = by_id_.find(id_json);
  return it == by_id_.end() ? nullptr : &predictions_[it->second];
}

Status PredictionsFile::Append(const Prediction& p) {
  json j;
  j["id"] = json::parse(p.id_json);
  j["prediction"] = p.prediction;
  j["ground_truth"] = json::parse(p.ground_truth_json);
  const std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    return IOError("cannot append to predictions file '" + path_ + "'");
  by_id_[p.id_json] = predictions_.size();
  predictions_.push_back(p);
  return Status::Ok();
}

}  // namespace kvtier::infbench
