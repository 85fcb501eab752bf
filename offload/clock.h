// Clock: where TieredStore reads the time for pin leases (a FetchHandle's pin
// protects its chunks for StoreOptions::pin_timeout_ms).
//
// Why an interface: lease expiry is the store's only time-dependent logic, and
// testing it against the wall clock meant sleeping past the lease and hoping the
// machine was not too busy to notice. With a ManualClock a test moves time by
// exactly the amount it means, and an engine with its own notion of time (a
// simulated step clock, say) can drive the leases with it.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>

namespace kvtier {

class Clock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  using duration = std::chrono::steady_clock::duration;
  virtual ~Clock() = default;
  /// Monotonic: never goes backwards. Called from any thread.
  virtual time_point Now() const = 0;
};

/// std::chrono::steady_clock, shared by every store that does not bring its own.
std::shared_ptr<const Clock> SteadyClock();

/// A clock that moves only when told to (tests, simulations). Thread-safe.
class ManualClock final : public Clock {
 public:
  /// Starts at `start` (any point works; leases only compare differences).
  explicit ManualClock(time_point start = time_point(std::chrono::hours(1)))
      : now_(start.time_since_epoch().count()) {}
  time_point Now() const override { return time_point(duration(now_.load(std::memory_order_acquire))); }
  /// Moves time forward by d (>= 0; a negative d is ignored: a clock must be monotonic).
  void Advance(duration d) {
    if (d.count() > 0) now_.fetch_add(d.count(), std::memory_order_acq_rel);
  }

 private:
  std::atomic<duration::rep> now_;
};

}  // namespace kvtier
