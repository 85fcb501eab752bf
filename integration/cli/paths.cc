#include "integration/cli/paths.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

namespace kvtier::cli {
namespace fs = std::filesystem;

Status CheckOutputPath(const std::string& flag, const std::string& path) {
  if (path.empty()) return InvalidArgument(flag + ": empty path");
  std::error_code ec;
  if (fs::is_directory(path, ec))
    return InvalidArgument(flag + " '" + path + "' is a directory: give a file name, e.g. " +
                           (fs::path(path) / "report.json").string());
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec))
    return InvalidArgument(flag + " '" + path + "': the directory '" + parent.string() +
                           "' does not exist (create it first, or write somewhere else)");
  const bool existed = fs::exists(path, ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    return InvalidArgument(flag + " '" + path + "' cannot be written: " + std::strerror(err) +
                           " (choose a writable path)");
  }
  ::close(fd);
  if (!existed) ::unlink(path.c_str());  // only a check: the job writes it at the end
  return Status::Ok();
}

FlagSet::Binding OutputPathFlag(std::string* dst) {
  return FlagSet::Binding(
      [dst](const std::string& s) {
        // The flag parser prefixes "--json: "; the check's own message names the path.
        Status st = CheckOutputPath("output file", s);
        if (!st.ok()) return st;
        *dst = s;
        return Status::Ok();
      },
      *dst);
}

Status CheckInputFile(const std::string& what, const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    return IOError(what + " '" + path + "': " + ec.message());
  if (!fs::exists(st)) return NotFound(what + " '" + path + "' does not exist");
  if (!fs::is_directory(st)) return Status::Ok();
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(path, ec))
    if (e.path().extension() == ".safetensors") found.push_back(e.path().string());
  std::sort(found.begin(), found.end());
  // The flag parser puts "--weights: " in front.
  std::string msg = "'" + path + "' is a directory, not a file";
  if (fs::exists(fs::path(path) / "config.json") && !found.empty()) {
    msg +=
        ". It looks like a Hugging Face export (config.json, " + fs::path(found.front()).filename().string() +
        "), which is for transformers (python -m kvtier.tools.infinitebench --model DIR); kvtier reads the "
        "kvtier-llama file it was exported from, e.g. --weights models/kvtier-tiny.safetensors";
  } else if (found.size() == 1) {
    msg += ": pass " + what + " " + found.front();
  } else if (!found.empty()) {
    msg += ": pass one of its files:";
    for (const std::string& f : found) msg += " " + f;
  } else {
    msg += " (and it holds no *.safetensors file)";
  }
  return InvalidArgument(msg);
}

namespace {

// The scratch directory to remove if a signal ends the process (one at a time: a command has
// at most one). A fixed buffer: the handler reads it without allocating.
char g_scratch[4096];

bool IsDotOrDotDot(const char* name) {
  return name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'));
}

// Removes `name` under the directory `parent` (a file, or a directory with everything in it)
// with async-signal-safe system calls only (unlinkat, openat, getdents64, lseek, close). The
// handler runs on whichever thread the signal lands on, possibly one inside malloc holding its
// arena lock, so it must not allocate: std::filesystem::remove_all does, and deadlocked there.
// Recursion stops `depth` levels down; each level keeps a 4 KiB buffer on the stack.
void RemoveTreeAt(int parent, const char* name, int depth) {
  if (unlinkat(parent, name, 0) == 0 || (errno != EISDIR && errno != EPERM) || depth == 0) return;
  const int dir = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir < 0) return;
  // Entries removed while reading may shift the directory's offsets: read it again from the
  // start until it is empty (a background thread, RocksDB flushing, may still be adding files).
  for (int pass = 0; pass < 64; ++pass) {
    if (lseek(dir, 0, SEEK_SET) != 0) break;
    alignas(dirent64) char buf[4096];
    ssize_t n;
    while ((n = getdents64(dir, buf, sizeof(buf))) > 0) {
      for (ssize_t off = 0; off < n;) {
        const auto* entry = reinterpret_cast<const dirent64*>(buf + off);
        off += entry->d_reclen;
        if (!IsDotOrDotDot(entry->d_name)) RemoveTreeAt(dir, entry->d_name, depth - 1);
      }
    }
    if (unlinkat(parent, name, AT_REMOVEDIR) == 0 || errno != ENOTEMPTY) break;
  }
  close(dir);
}

void RemoveScratchAndExit(int sig) {
  if (g_scratch[0] != '\0') RemoveTreeAt(AT_FDCWD, g_scratch, 32);  // best effort: the process ends now
  std::_Exit(128 + sig);
}

}  // namespace

ScratchDir::ScratchDir(const std::string& prefix) {
  std::error_code ec;
  fs::path base = fs::temp_directory_path(ec);  // $TMPDIR, else /tmp
  if (ec) base = "/tmp";
  std::string tmpl = (base / (prefix + "-XXXXXX")).string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    error_ = "cannot create a temporary data directory under '" + base.string() +
             "': " + std::strerror(errno) + " (set TMPDIR, or give --data-dir DIR)";
    return;
  }
  path_ = tmpl;
  if (path_.size() < sizeof(g_scratch)) {
    std::memcpy(g_scratch, path_.c_str(), path_.size() + 1);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, RemoveScratchAndExit);
  }
}

ScratchDir::~ScratchDir() {
  if (path_.empty()) return;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, SIG_DFL);
  g_scratch[0] = '\0';
  std::error_code ec;
  fs::remove_all(path_, ec);
}

}  // namespace kvtier::cli
