// A method's predictions on one ∞-Bench task, as the benchmark's own scorer reads them
// (src/compute_scores.py: results/<model>/preds_<task>.jsonl): one line per sample,
//   {"id": 3, "prediction": "71432", "ground_truth": ["71432"]}
// written (and flushed) as each prediction is made, so that a run killed at any moment keeps
// every finished sample. Reopening the file resumes: the ids already there are done; a last
// line cut short by the kill is dropped (the file is cut back to its last whole line).
#pragma once

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/status.h"

namespace kvtier::infbench {

struct Prediction {
  std::string id_json, prediction, ground_truth_json;
};

class PredictionsFile {
 public:
  /// Opens `path` for appending, creating it and its folder; reads the predictions already in
  /// it. A line that is not a prediction (other than a cut-short last line) -> InvalidArgument
  /// naming the file and line.
  static Result<std::unique_ptr<PredictionsFile>> Open(const std::string& path);
  ~PredictionsFile();
  PredictionsFile(const PredictionsFile&) = delete;
  PredictionsFile& operator=(const PredictionsFile&) = delete;

  /// The predictions read at Open, then those appended, in file order.
  const std::vector<Prediction>& predictions() const { return predictions_; }
  /// The prediction of sample `id_json` already in the file, or null.
  const Prediction* Find(const std::string& id_json) const;
  /// Appends one line and flushes it to the OS.
  Status Append(const Prediction& p);
  /// Lines dropped at Open because the last one was cut short (0 or 1).
  int dropped_partial_lines() const { return dropped_; }
  const std::string& path() const { return path_; }

 private:
  PredictionsFile() = default;
  std::string path_;
  std::FILE* file_ = nullptr;
  std::vector<Prediction> predictions_;
  std::map<std::string, size_t> by_id_;  // id -> its index in predictions_
  int dropped_ = 0;
};

}  // namespace kvtier::infbench
