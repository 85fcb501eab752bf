// Small helpers shared by the tests.
#pragma once

#include <cstdlib>
#include <filesystem>
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
#define KVTIER_SKIP_UNDER_SANITIZER(why)                                                              \
  do {                                                                                                \
    if (::kvtier::kTestSanitizer != nullptr)                                                          \
      GTEST_SKIP() << "skipped under " << ::kvtier::kTestSanitizer << ": " << why;                  \
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

}  // namespace kvtier
