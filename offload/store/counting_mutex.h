// CountingMutex: TieredStore's mutex, a std::mutex that counts its lock entries. Every entry
// counts, a wait's re-entry on wake-up included, so a test can hold a layer step to a bound
// of lock entries (tests/tiered_store_test_peer.h, LockEntries). The count is a relaxed atomic
// add on an uncontended cache line, next to the lock it counts: no ordering, nothing else.
// Waits on it use std::condition_variable_any.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

namespace kvtier {

class CountingMutex {
 public:
  void lock() {
    mu_.lock();
    entries_.fetch_add(1, std::memory_order_relaxed);
  }
  bool try_lock() {
    if (!mu_.try_lock()) return false;
    entries_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  void unlock() { mu_.unlock(); }
  /// Lock entries so far.
  uint64_t entries() const { return entries_.load(std::memory_order_relaxed); }

 private:
  std::mutex mu_;
  std::atomic<uint64_t> entries_{0};
};

}  // namespace kvtier
