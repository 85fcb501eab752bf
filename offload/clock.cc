#include "offload/clock.h"

namespace kvtier {
namespace {
class RealSteadyClock final : public Clock {
 public:
  time_point Now() const override { return std::chrono::steady_clock::now(); }
};
}  // namespace

std::shared_ptr<const Clock> SteadyClock() {
  // One instance for the process; never destroyed before its last user (shared_ptr).
  static const std::shared_ptr<const Clock> clock = std::make_shared<RealSteadyClock>();
  return clock;
}

}  // namespace kvtier
