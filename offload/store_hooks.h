// StoreHooks: what tests and tools plug into a TieredStore and an engine does not: a hot tier
// of their own (a device stand-in, the Python binding's scrambled tier), the clock of the pin
// leases, and a fault injector for the cold tier. Internal to kvtier (not installed), passed to
// TieredStore::Open(options, hooks). A pluggable hot tier is therefore not public: the
// HotTier interface (offload/hot_tier.h) is not installed, and an engine chooses among
// kvtier's own hot tiers with StoreOptions::device.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string_view>

#include "kvtier/status.h"
#include "offload/clock.h"
#include "offload/hot_tier.h"
#include "store/chunk.h"

namespace kvtier {

struct StoreHooks {
  /// A hot tier of the caller's: called with hot_bytes and the chunk size instead of building
  /// kvtier's tier on StoreOptions::device, which is then neither used nor checked. The tier
  /// must have at least one slot, each of exactly chunk_bytes(). Default: none (MakeHotTier).
  std::function<Result<std::unique_ptr<HotTier>>(size_t slot_pool_bytes, size_t slot_bytes)> hot_tier_factory;
  /// Time source of the pin leases (StoreOptions::pin_timeout_ms); tests pass a ManualClock.
  /// Must not be null. Default: the steady clock.
  std::shared_ptr<const Clock> clock = SteadyClock();
  /// Passed to the cold tier (ColdTierOptions::fault_injector), to break it on purpose.
  /// Default: none.
  std::function<Status(std::string_view op, const ChunkKey& key)> cold_fault_injector;
  /// Asked before a landing that must not wait checks a chunk's download (Landing::LandLayer
  /// with only_complete: Append's, and a device step's BeginLayerStep with
  /// LandRule::kCompleteOnly); true answers "not done" whatever the hot tier says, so the chunk
  /// stays landing until a call that waits lands it (the copy itself completes as usual). A
  /// test's way to hold chunks landing on a tier whose copies finish at once. Default: none.
  std::function<bool()> hold_landing;

  /// InvalidArgument naming the hook that is wrong.
  Status Validate() const {
    if (clock == nullptr) return InvalidArgument("clock must not be null (the default is the steady clock)");
    return Status::Ok();
  }
};

}  // namespace kvtier
