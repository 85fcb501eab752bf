// Status / Result<T>: value() of an error fails loudly in every build type, and a bad_alloc at
// an API boundary comes back as ResourceExhausted.
#include "store/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <new>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace kvtier {
namespace {

Result<int> Fails() { return NotFound("no such thing"); }

// Every code has its own name; PermissionDenied (refused credentials) is the last one and is
// what the C API and Python mirror (KVTIER_PERMISSION_DENIED, kvtier.PermissionDenied).
TEST(Status, EveryCodeIsNamedIncludingPermissionDenied) {
  EXPECT_STREQ(StatusCodeName(StatusCode::kPermissionDenied), "PermissionDenied");
  EXPECT_EQ(static_cast<int>(StatusCode::kPermissionDenied), 11);
  EXPECT_EQ(PermissionDenied("redis h:1: WRONGPASS").ToString(), "PermissionDenied: redis h:1: WRONGPASS");
  for (int c = 0; c <= static_cast<int>(StatusCode::kPermissionDenied); ++c)
    EXPECT_STRNE(StatusCodeName(static_cast<StatusCode>(c)), "Unknown") << c;
}

// In a Release build (NDEBUG) the former assert() was compiled out and value() read an empty
// optional; now it prints the status and aborts whatever the build type.
TEST(ResultDeathTest, ValueOfAnErrorAbortsNamingTheStatus) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH({ [[maybe_unused]] int v = Fails().value(); },
               "value\\(\\) called on an error: NotFound: no such thing");
  EXPECT_DEATH(
      {
        const Result<int> r = Fails();
        [[maybe_unused]] int v = r.value();
      },
      "NotFound: no such thing");
  EXPECT_DEATH(
      {
        Result<std::string> r = InvalidArgument("bad");
        [[maybe_unused]] size_t n = r->size();
      },
      "InvalidArgument: bad");
  EXPECT_DEATH(
      {
        Result<std::unique_ptr<int>> r = Internal("boom");
        [[maybe_unused]] std::unique_ptr<int> p = *std::move(r);
      },
      "Internal: boom");
}

TEST(Result, ValueOfAnOkResult) {
  Result<int> r = 7;
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value(), 7);
  EXPECT_EQ(*r, 7);
  Result<std::string> s = std::string("abc");
  EXPECT_EQ(s->size(), 3u);
  EXPECT_EQ(std::move(s).value(), "abc");
}

TEST(ReturnOnBadAlloc, TurnsBadAllocIntoResourceExhaustedNamingWhat) {
  Status st = ReturnOnBadAlloc("the widget table", []() -> Status { throw std::bad_alloc(); });
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), "the widget table: out of memory");
  Result<std::vector<int>> r =
      ReturnOnBadAlloc([] { return std::string("rows for ") + std::to_string(12) + " keys"; },
                       []() -> Result<std::vector<int>> { throw std::bad_alloc(); });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status().message(), "rows for 12 keys: out of memory");
  // Success and other errors pass through unchanged.
  EXPECT_TRUE(ReturnOnBadAlloc("x", [] { return Status::Ok(); }).ok());
  EXPECT_EQ(ReturnOnBadAlloc("x", [] { return NotFound("n"); }).code(), StatusCode::kNotFound);
  Result<int> ok = ReturnOnBadAlloc("x", []() -> Result<int> { return 3; });
  EXPECT_EQ(*ok, 3);
}

TEST(ReturnOnBadAlloc, AnAllocationNoAllocatorCanServe) {
  KVTIER_SKIP_UNDER_SANITIZER(
      "ASan aborts on an allocation beyond its maximum instead of throwing std::bad_alloc");
  Result<size_t> huge = ReturnOnBadAlloc("a vector of 2^60 floats", []() -> Result<size_t> {
    std::vector<float> v(size_t{1} << 60);  // 4 EiB: within max_size(), beyond any allocator
    return v.size();
  });
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvtier
