// What ThreadSanitizer cannot see of oneTBB, said explicitly.
//
// Debian's libtbb is not instrumented, so TSan does not see the synchronisation by which
// oneTBB hands work to a worker (the fork: the caller's writes before tbb::parallel_for or
// task_arena::enqueue happen before the body runs) or by which parallel_for returns after
// every body ran (the join: the bodies' writes happen before the caller's reads after it).
// Without these edges, every piece of data a body reads or writes looks like a race with
// its caller, and the TSan job (make test-tsan) would be noise. These annotate exactly
// those two edges at our call sites and nothing else, so that a race between two bodies,
// or between a task and the thread that did not hand it over, is still reported. In a
// build without TSan they are empty inline functions: no code.
//
// Use around a parallel_for:
//   TsanForkJoin fj;                                   // fork: release
//   tbb::parallel_for(range, fj.Body([&](auto& r) {...}));  // each body: acquire ... release
//   fj.Join();                                         // join: acquire
// The memory oneTBB itself moves between threads (its task objects, reused by its small
// object pool) is covered by tests/tsan.supp instead.
#pragma once

#include <utility>

#if defined(__SANITIZE_THREAD__)
#define KVTIER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVTIER_TSAN 1
#endif
#endif

#ifdef KVTIER_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace kvtier {

/// The calling thread's accesses so far happen before those of a thread that later
/// calls TsanAcquire on the same address.
inline void TsanRelease(const void* sync) {
#ifdef KVTIER_TSAN
  __tsan_release(const_cast<void*>(sync));
#else
  (void)sync;
#endif
}

inline void TsanAcquire(const void* sync) {
#ifdef KVTIER_TSAN
  __tsan_acquire(const_cast<void*>(sync));
#else
  (void)sync;
#endif
}

/// The fork and join of one tbb::parallel_for (see the top of the file).
class TsanForkJoin {
 public:
  TsanForkJoin() { TsanRelease(&fork_); }
  TsanForkJoin(const TsanForkJoin&) = delete;
  TsanForkJoin& operator=(const TsanForkJoin&) = delete;

  /// `body` wrapped: acquires the fork first, releases into the join last.
  template <typename F>
  auto Body(const F& body) const {
    return [this, &body](auto&&... args) {
      TsanAcquire(&fork_);
      body(std::forward<decltype(args)>(args)...);
      TsanRelease(&join_);
    };
  }
  /// After parallel_for returned: every body's accesses happen before what follows.
  void Join() const { TsanAcquire(&join_); }

 private:
  char fork_ = 0, join_ = 0;
};

}  // namespace kvtier
