// A full disk under the cold tier (offload/cold_tier.h, "A full disk, or any write error"):
// a store writes through to a 16 MiB tmpfs until it is full. The first error is an IOError
// naming the directory and ENOSPC, later writes fail at once with one message naming that
// first error, every token appended before still reads back, the process closes the store
// without aborting, and a reopen of the full directory returns an error. Writer and reopen
// run in child processes (this binary re-executed), so an abort inside RocksDB is a signal
// seen here, not the end of the test binary. Without permission to mount (not root, or no
// CAP_SYS_ADMIN) the test skips and says so.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "integration/pattern.h"
#include "offload/tiered_store.h"
#include "tests/crash_layout.h"

extern char** environ;

namespace kvtier {
namespace {

constexpr int kTmpfsMiB = 16;

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A tmpfs of `mib` MiB on a fresh directory under /tmp, unmounted (lazily, so a file still
// open cannot keep it) and removed on every way out of the test.
class SmallTmpfs {
 public:
  explicit SmallTmpfs(int mib) {
    char tmpl[] = "/tmp/kvtier_full_disk_XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      why_not_ = std::string("mkdtemp: ") + std::strerror(errno);
      return;
    }
    dir_ = tmpl;
    const std::string data = "size=" + std::to_string(mib) + "m,mode=0700";
    if (mount("kvtier_full_disk", dir_.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, data.c_str()) != 0) {
      why_not_ = "mounting a " + std::to_string(mib) + " MiB tmpfs on " + dir_ + " is not allowed here (" +
                 std::strerror(errno) + "; needs root or CAP_SYS_ADMIN)";
      return;
    }
    mounted_ = true;
  }
  ~SmallTmpfs() {
    if (mounted_ && umount2(dir_.c_str(), MNT_DETACH) != 0)
      ADD_FAILURE() << "umount " << dir_ << ": " << std::strerror(errno);
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  bool mounted() const { return mounted_; }
  // Resizes the mounted tmpfs to `bytes` (rounded up to whole pages); an error message or "".
  std::string Resize(uint64_t bytes) {
    const std::string data = "size=" + std::to_string(bytes);
    if (mount("kvtier_full_disk", dir_.c_str(), "tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV, data.c_str()) !=
        0)
      return "remount " + dir_ + " " + data + ": " + std::strerror(errno);
    return "";
  }
  const std::string& why_not() const { return why_not_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_, why_not_;
  bool mounted_ = false;
};

struct ChildRun {
  int status = 0;
  std::string output;  // stdout and stderr together
};

// Re-executes this binary running only `test`, with KVTIER_FULL_DISK_DIR=dir.
ChildRun RunChild(const std::string& test, const std::string& dir) {
  ChildRun r;
  int fds[2];
  if (pipe(fds) != 0) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return r;
  }
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  env.push_back("KVTIER_FULL_DISK_DIR=" + dir);
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=" + test;
  char* argv[] = {exe.data(), filter.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    ADD_FAILURE() << "posix_spawn: " << std::strerror(rc);
    return r;
  }
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) r.output.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  waitpid(pid, &r.status, 0);
  return r;
}

std::string Describe(int status) {
  if (WIFSIGNALED(status))
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  if (WIFEXITED(status)) return "exited with " + std::to_string(WEXITSTATUS(status));
  return "status " + std::to_string(status);
}

// ---- the child processes ------------------------------------------------------------------

const char* ChildDir() { return std::getenv("KVTIER_FULL_DISK_DIR"); }

// Appends deterministic K/V through a write-through store until the disk is full.
TEST(FullDiskChild, FillThenWriteAgain) {
  if (ChildDir() == nullptr) GTEST_SKIP() << "helper of FullDisk.WriteErrorLatchesAndReopenFails";
  alarm(60);  // a hang ends as SIGALRM, which the parent reports
  const std::string dir = ChildDir();
  StoreOptions o = CrashTestOptions(dir);
  auto opened = TieredStore::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TieredStore& store = **opened;
  std::vector<SequenceId> seqs;
  for (int i = 0; i < kCrashSequences; ++i) {
    auto s = store.CreateSequence();
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    seqs.push_back(*s);
  }
  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  const int layers = o.geometry.layers;
  std::vector<uint8_t> k, v;
  // Appends n tokens at the layer's current end.
  auto append = [&](SequenceId seq, int l, int n) {
    const int64_t at = *store.SequenceLength(seq, l);
    k.resize(n * tb);
    v.resize(n * tb);
    FillPattern(kCrashSalt, seq, l, 0, at, n, tb, k.data());
    FillPattern(kCrashSalt, seq, l, 1, at, n, tb, v.data());
    return store.Append(seq, l, k.data(), v.data(), n, o.geometry.dtype);
  };
  Status first;
  SequenceId failed_seq = 0;
  int failed_layer = 0;
  for (int round = 0; round < 100000 && first.ok(); ++round)
    for (SequenceId seq : seqs)
      for (int l = 0; l < layers && first.ok(); ++l) {
        first = append(seq, l, 1 + round % 61);
        failed_seq = seq;
        failed_layer = l;
      }
  ASSERT_FALSE(first.ok()) << "a " << kTmpfsMiB << " MiB disk never filled";
  std::printf("first error: %s\n", first.ToString().c_str());
  EXPECT_EQ(first.code(), StatusCode::kIOError) << first.ToString();
  EXPECT_TRUE(Contains(first.message(), dir)) << first.ToString();
  EXPECT_TRUE(Contains(first.message(), "No space left on device")) << first.ToString();

  // Writes still in flight finish (and fail) first; WaitForDurable reports (and so clears) the
  // store's background error. Appends that fit in the warm tier may still succeed; once the
  // warm tier is full every append needs the cold tier, and the cold tier's latched error
  // (which names the directory and the first error) answers it.
  const Status durable = store.WaitForDurable();
  std::printf("WaitForDurable: %s\n", durable.ToString().c_str());
  const std::string latched = "'" + dir + "' takes no more writes after its first write error";
  std::string later;
  int accepted = 0;
  for (int i = 0; i < 100000 && !Contains(later, latched); ++i) {
    const Status st = append(failed_seq, failed_layer, 61);
    if (st.ok()) {
      ++accepted;
      continue;
    }
    EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
    later = st.message();
    if (!Contains(later, latched)) (void)store.WaitForDurable();  // a background error first
  }
  std::printf("appends the warm tier still took: %d\n", accepted);
  ASSERT_TRUE(Contains(later, latched)) << "the cold tier never refused a write: " << later;

  // From then on writes fail at once, each an IOError naming the directory and the disk.
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) {
    const Status st = append(failed_seq, failed_layer, 61);
    ASSERT_FALSE(st.ok()) << "write " << i << " after the cold tier latched its error returned OK";
    EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
    EXPECT_TRUE(Contains(st.message(), dir)) << st.ToString();
    EXPECT_TRUE(Contains(st.message(), "No space left on device")) << st.ToString();
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("later error (20 writes in %.1f ms): %s\n", ms, later.c_str());
  EXPECT_LT(ms, 2000.0) << "later writes do not fail fast";

  // Nothing is lost: every token appended reads back, from the cold tier where it took the
  // chunk, else from the warm or hot tier that kept it.
  for (SequenceId seq : seqs)
    for (int l = 0; l < layers; ++l) {
      const int64_t n = *store.SequenceLength(seq, l);
      std::vector<uint8_t> gk(n * tb), gv(n * tb), wk(n * tb), wv(n * tb);
      ASSERT_TRUE(store.ReadTokens(seq, l, 0, n, gk.data(), gv.data()).ok())
          << "seq " << seq << " layer " << l;
      FillPattern(kCrashSalt, seq, l, 0, 0, n, tb, wk.data());
      FillPattern(kCrashSalt, seq, l, 1, 0, n, tb, wv.data());
      ASSERT_TRUE(gk == wk && gv == wv) << "seq " << seq << " layer " << l << ": tokens differ";
    }
  std::printf("cold chunks acknowledged: %llu\n",
              static_cast<unsigned long long>(store.counters().cold_chunks));
  // The store closes here: RocksDB used to abort in its close (or earlier) after the error.
}

// Reopens the full directory: an error, not an abort.
TEST(FullDiskChild, ReopenFull) {
  if (ChildDir() == nullptr) GTEST_SKIP() << "helper of FullDisk.WriteErrorLatchesAndReopenFails";
  alarm(60);
  const std::string dir = ChildDir();
  auto opened = TieredStore::Open(CrashTestOptions(dir));
  ASSERT_FALSE(opened.ok()) << "a store on the full disk opened";
  std::printf("reopen: %s\n", opened.status().ToString().c_str());
  EXPECT_EQ(opened.status().code(), StatusCode::kIOError) << opened.status().ToString();
  EXPECT_TRUE(Contains(opened.status().message(), dir)) << opened.status().ToString();
}

// Reopens the directory once the disk has room again: every acknowledged chunk is there (the
// open's acknowledgement check passes) and every token of the store reads back.
TEST(FullDiskChild, ReopenWithRoom) {
  if (ChildDir() == nullptr) GTEST_SKIP() << "helper of FullDisk.WriteErrorLatchesAndReopenFails";
  alarm(60);
  const std::string dir = ChildDir();
  auto opened = TieredStore::Open(CrashTestOptions(dir));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  std::printf("reopened with %zu acknowledged chunks\n",
              (*opened)->lower_tiers().AcknowledgedChunks().size());
  EXPECT_GT((*opened)->lower_tiers().AcknowledgedChunks().size(), 0u);
}

// The bytes of the directory's write-ahead logs (RocksDB's numbered *.log files).
uint64_t WalBytes(const std::string& dir) {
  uint64_t bytes = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && name.size() > 4 && name.compare(name.size() - 4, 4, ".log") == 0 &&
        std::isdigit(static_cast<unsigned char>(name[0])))
      bytes += e.file_size();
  }
  return bytes;
}

uint64_t FreeBytes(const std::string& dir) {
  struct statvfs v {};
  return statvfs(dir.c_str(), &v) == 0 ? static_cast<uint64_t>(v.f_bavail) * v.f_frsize : 0;
}

// ---- the test -------------------------------------------------------------------------------

TEST(FullDisk, WriteErrorLatchesAndReopenFails) {
  if (ChildDir() != nullptr) GTEST_SKIP() << "this is a child process";
  SmallTmpfs disk(kTmpfsMiB);
  if (!disk.mounted()) GTEST_SKIP() << disk.why_not();
  const std::string dir = disk.dir() + "/store";

  const ChildRun fill = RunChild("FullDiskChild.FillThenWriteAgain", dir);
  EXPECT_TRUE(WIFEXITED(fill.status) && WEXITSTATUS(fill.status) == 0)
      << "writer " << Describe(fill.status) << "; its output:\n"
      << fill.output;
  EXPECT_TRUE(Contains(fill.output, "[  PASSED  ] 1 test")) << fill.output;

  // Twice: a failed reopen must leave the directory as refusable as it found it.
  for (int i = 0; i < 2; ++i) {
    const ChildRun reopen = RunChild("FullDiskChild.ReopenFull", dir);
    EXPECT_TRUE(WIFEXITED(reopen.status) && WEXITSTATUS(reopen.status) == 0)
        << "reopen " << i << " " << Describe(reopen.status) << "; its output:\n"
        << reopen.output;
    EXPECT_TRUE(Contains(reopen.output, "[  PASSED  ] 1 test")) << reopen.output;
  }

  // The rule docs/reliability.md states: a store that filled its disk reopens once about its
  // WAL's size is free again (the read-write open flushes the WAL into a table before it
  // deletes it), here the WAL's bytes plus 1 MiB for the new MANIFEST, WAL, OPTIONS and LOG.
  const uint64_t wal = WalBytes(dir), room = wal + (uint64_t{1} << 20);
  std::printf("WAL %llu bytes, %llu bytes free before growing the disk\n",
              static_cast<unsigned long long>(wal), static_cast<unsigned long long>(FreeBytes(disk.dir())));
  const std::string resized = disk.Resize((uint64_t{kTmpfsMiB} << 20) + room);
  ASSERT_EQ(resized, "");
  std::printf("%llu bytes free after growing it\n", static_cast<unsigned long long>(FreeBytes(disk.dir())));
  const ChildRun roomy = RunChild("FullDiskChild.ReopenWithRoom", dir);
  EXPECT_TRUE(WIFEXITED(roomy.status) && WEXITSTATUS(roomy.status) == 0)
      << "reopen with room " << Describe(roomy.status) << "; its output:\n"
      << roomy.output;
  EXPECT_TRUE(Contains(roomy.output, "[  PASSED  ] 1 test")) << roomy.output;
}

}  // namespace
}  // namespace kvtier
