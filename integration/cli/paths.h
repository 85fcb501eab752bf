// Where `kvtier` commands read and write: output paths checked before any work starts (an
// unwritable --json fails at once, not after a ten-minute run), input files that name the
// fix when they are not files, and the temporary data directory `kvtier run` and
// `kvtier stress` use when no --data-dir is given (removed at the end, also on error).
#pragma once

#include <string>

#include "integration/cli/flags.h"
#include "store/status.h"

namespace kvtier::cli {

/// Whether `path` can be written as an output file: its directory exists and is writable, and
/// `path` is not a directory. Checked by creating the file if it is missing (and removing it
/// again), so an existing file is left untouched. `flag` ("--json") names the flag in the message.
Status CheckOutputPath(const std::string& flag, const std::string& path);

/// An output-file flag bound to *dst: the path must be writable when the flag is parsed
/// (CheckOutputPath), so a bad --json fails before the job runs.
FlagSet::Binding OutputPathFlag(std::string* dst);

/// An input file that must be a regular file: a directory is InvalidArgument saying so and,
/// when it holds *.safetensors files (an HF export: config.json + model.safetensors), which
/// file to pass instead; a missing path is NotFound. `what` names the input ("--weights").
Status CheckInputFile(const std::string& what, const std::string& path);

/// A fresh directory under $TMPDIR (or /tmp), removed with everything in it when the object
/// goes out of scope, and by SIGINT / SIGTERM / SIGHUP while it lives (then the process exits
/// with 128 + the signal). Empty path() = creation failed (error() says why).
class ScratchDir {
 public:
  /// prefix: the name's start, "kvtier-run" -> $TMPDIR/kvtier-run-XXXXXX.
  explicit ScratchDir(const std::string& prefix);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }

 private:
  std::string path_, error_;
};

}  // namespace kvtier::cli
