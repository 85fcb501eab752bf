// Runs a child writer (tests/child_*.cc) and SIGKILLs it mid-run: shared by the crash
// test and the soak, which differ only in what the child does and prints.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

extern char** environ;

namespace kvtier {

/// Starts KVTIER_BINARY_DIR/`child` with arguments (dir, seed) and returns every complete
/// line it printed; once `kill_after` lines starting with "ACK " were printed (or a few
/// more: the kill races with the child, as it should) it is SIGKILLed. *status gets its
/// wait status, *killed whether the kill was sent. A partial last line is not returned.
inline std::vector<std::string> RunChildUntilAcks(const std::string& child, const std::string& dir,
                                                  uint64_t seed, size_t kill_after, int* status,
                                                  bool* killed) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  const std::string exe = std::string(KVTIER_BINARY_DIR) + "/" + child;
  const std::string seed_s = std::to_string(seed);
  char* argv[] = {const_cast<char*>(exe.c_str()), const_cast<char*>(dir.c_str()),
                  const_cast<char*>(seed_s.c_str()), nullptr};
  pid_t pid = 0;
  EXPECT_EQ(posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, environ), 0) << exe;
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  std::vector<std::string> lines;
  std::string buf;
  size_t acks = 0;
  *killed = false;
  char tmp[4096];
  for (;;) {
    const ssize_t n = read(fds[0], tmp, sizeof(tmp));
    if (n <= 0) break;
    buf.append(tmp, static_cast<size_t>(n));
    size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos) {
      lines.push_back(buf.substr(0, nl));
      buf.erase(0, nl + 1);
      if (lines.back().rfind("ACK ", 0) == 0) ++acks;
    }
    if (!*killed && acks >= kill_after) {
      kill(pid, SIGKILL);  // mid-run: appends and cold writes are in flight
      *killed = true;
    }
  }
  waitpid(pid, status, 0);
  close(fds[0]);
  return lines;
}

}  // namespace kvtier
