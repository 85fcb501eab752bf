// A layer's hot regions in one place: the sinks and the local ring (K and V) of one
// (sequence, layer) in hot memory and the ring's attention mass, allocated, restored and freed
// the same way for a new sequence (TieredStore::CreateSequence), a recovered one
// (offload/store_recovery.cc) and an attached one (offload/store/sharing.cc).
//
// Locking: none; the regions belong to the sequence's driving thread (offload/store_state.h),
// and a sequence is set up before it becomes visible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvtier/options.h"
#include "offload/hot_tier.h"
#include "offload/store_state.h"
#include "store/status.h"

namespace kvtier {
namespace store_internal {

/// Hot memory one layer's regions take: sinks and ring (n_local + chunk_size tokens), K and V.
uint64_t LayerRegionBytes(const StoreOptions& o, size_t token_bytes);
/// Allocates one layer's regions in `hot` (the sinks at least one byte, so spans stay valid
/// with n_sink = 0) and zeroes the ring's attention mass. On failure, what was allocated
/// stays on `ls` for FreeLayerRegions.
Status AllocateLayerRegions(const StoreOptions& o, size_t token_bytes, HotTier* hot, LayerState* ls);
/// Fills allocated regions with a layer's sinks and local window as CloseSequence persists them
/// ([K][V] of the sinks, [K][V] of the local window), at the positions ls->n_tokens and
/// ls->sealed_end give. The caller has checked the sizes.
Status RestoreLayerRegions(const StoreOptions& o, size_t token_bytes, HotTier* hot, std::string_view sinks,
                           std::string_view local, LayerState* ls);
/// Frees whatever regions `ls` holds (null ones are skipped) and clears its pointers.
void FreeLayerRegions(HotTier* hot, LayerState* ls);

}  // namespace store_internal
}  // namespace kvtier
