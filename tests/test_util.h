// Small helpers shared by the tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <sstream>
#include <string>

// Which sanitizer this build runs under (KVTIER_SANITIZE), or null. Tests that measure
// memory (RSS) or allocate up to a limit skip themselves under one: ASan reserves terabytes
// of shadow address space (an RLIMIT_AS cap stops it first), keeps freed memory in a
// quarantine (RSS is not what the code holds) and aborts on an allocation it cannot
// serve instead of throwing std::bad_alloc; TSan shadows every byte four times over.
#if defined(__SANITIZE_ADDRESS__)
#define KVTIER_TEST_SANITIZER "AddressSanitizer"
#elif defined(__SANITIZE_THREAD__)
#define KVTIER_TEST_SANITIZER "ThreadSanitizer"
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVTIER_TEST_SANITIZER "AddressSanitizer"
#elif __has_feature(thread_sanitizer)
#define KVTIER_TEST_SANITIZER "ThreadSanitizer"
#elif __has_feature(memory_sanitizer)
#define KVTIER_TEST_SANITIZER "MemorySanitizer"
#endif
#endif

namespace kvtier {

#ifdef KVTIER_TEST_SANITIZER
inline constexpr const char* kTestSanitizer = KVTIER_TEST_SANITIZER;
#else
inline constexpr const char* kTestSanitizer = nullptr;
#endif

/// In a test body (or SetUp): skips the test under a sanitizer, saying which and why.
#define KVTIER_SKIP_UNDER_SANITIZER(why)                                           \
  do {                                                                             \
    if (::kvtier::kTestSanitizer != nullptr)                                       \
      GTEST_SKIP() << "skipped under " << ::kvtier::kTestSanitizer << ": " << why; \
  } while (0)

/// A fresh directory under /tmp, removed with everything in it when the
/// object goes out of scope.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvtier-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Every regular file under `dir` (recursively), by relative path, with its bytes: what
/// "the directory was left byte for byte as it was" compares.
inline std::map<std::string, std::string> DirectorySnapshot(const std::string& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    out[fs::relative(e.path(), dir).string()] =
        std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  return out;
}

/// Runs `body` in a forked child that drops to the unprivileged user nobody (65534) first
/// when the tests run as root, and returns what it returned: the way to see EACCES, which
/// root never gets. "child failed: ..." when the child could not run it.
inline std::string InChildAsNobody(const std::function<std::string()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) return "child failed: pipe";
  const pid_t pid = ::fork();
  if (pid < 0) return "child failed: fork";
  if (pid == 0) {
    ::close(fds[0]);
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(3);
    const std::string out = body();
    if (::write(fds[1], out.data(), out.size()) < 0) ::_exit(4);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string got;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) got.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int wst = 0;
  if (::waitpid(pid, &wst, 0) != pid || !WIFEXITED(wst) || WEXITSTATUS(wst) != 0)
    return "child failed: status " + std::to_string(wst) + ", output '" + got + "'";
  return got;
}

#ifdef KVTIER_BINARY_DIR
namespace test {

/// What a run of the built `kvtier` binary printed (stdout and stderr) and its exit code.
struct Ran {
  int code = -1;
  std::string out;
};

/// Runs `kvtier ARGS` from the build directory (KVTIER_BINARY_DIR, set for kvtier_tests).
/// `prefix` goes before the command in the shell: "cd DIR && TMPDIR=T " runs it elsewhere.
/// stderr is a pipe here, never a terminal.
inline Ran Kvtier(const std::string& args, const std::string& prefix = "") {
  const std::string cmd = prefix + std::string(KVTIER_BINARY_DIR) + "/kvtier " + args + " 2>&1";
  Ran r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

/// A file's whole contents ("" when it cannot be read).
inline std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace test
#endif  // KVTIER_BINARY_DIR

}  // namespace kvtier
