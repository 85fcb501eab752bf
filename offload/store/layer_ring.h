// LayerRing: the arithmetic of one (sequence, layer)'s hot regions, the attention sinks and the
// local ring (offload/store_state.h, LayerState: sink_*, ring_*, ring_mass, n_tokens,
// sealed_end). Tokens [0, n_sink) are the sinks; token p >= n_sink sits at ring position
// (p - n_sink) % (n_local + chunk_size). Append fills the sinks, then the ring, and asks for
// the ring's oldest chunk_size tokens to be sealed when it is full; View gives attention the
// sinks and the local window (up to two runs of the ring); the ring's attention mass is the
// statistics a sealed chunk's representatives are chosen from. The regions themselves are
// allocated by offload/store/layer_regions.h and owned by the layer.
//
// Locking: none. A layer's regions belong to the sequence's driving thread (one at a time);
// the caller holds the sequence busy while it copies.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvtier/options.h"
#include "offload/hot_tier.h"
#include "offload/store_state.h"
#include "offload/store_types.h"
#include "store/status.h"

namespace kvtier {

class LayerRing {
 public:
  /// Copies `bytes` from `src` into hot memory at `dst` (HotTier::Upload or CopyWithin).
  using CopyIn = std::function<Status(uint8_t* dst, const uint8_t* src, size_t bytes)>;

  LayerRing(const StoreOptions& options, size_t token_bytes);

  /// Tokens the ring holds: n_local + chunk_size.
  int64_t capacity() const { return capacity_; }
  /// Appends n tokens (K and V, [n, kv_heads, head_dim] each) with `copy_in`, calling `seal`
  /// whenever the ring is full before a copy (it must seal the oldest chunk: AdvancePastOldestChunk).
  /// Stops at the first failure; the tokens copied before it stay appended.
  Status Append(store_internal::LayerState& ls, const uint8_t* k, const uint8_t* v, int n,
                const CopyIn& copy_in, const std::function<Status()>& seal) const;
  /// The sinks and local window of the layer (FailedPrecondition for a sequence recovered
  /// without them).
  Status View(SequenceId seq, const store_internal::LayerState& ls, HotView* v) const;
  /// Adds attention mass ([repr_head_count(), n] fp32: per kv head, or per query head under
  /// ReprHeads::kQuery) received by tokens [first, first + n), which must
  /// lie in the local window (InvalidArgument naming both otherwise).
  Status AddMass(store_internal::LayerState& ls, int64_t first, int n, const float* mass) const;

  /// The ring position of the oldest unsealed chunk (a multiple of chunk_size: chunks never wrap).
  int64_t OldestChunkSlot(const store_internal::LayerState& ls) const;
  /// The attention mass of the oldest unsealed chunk's tokens, [repr_head_count(), chunk_size].
  std::vector<float> OldestChunkMass(const store_internal::LayerState& ls) const;
  /// Seals the oldest chunk out of the ring: its mass is reset and sealed_end moves past it.
  void AdvancePastOldestChunk(store_internal::LayerState& ls) const;
  /// K then V of the sinks and of the local window, read from hot memory through `hot`, as
  /// CloseSequence persists them and RestoreLayerRegions reads them back.
  Status CopyOut(HotTier* hot, const store_internal::LayerState& ls, std::string* sinks,
                 std::string* local) const;

 private:
  const StoreOptions& options_;
  size_t token_bytes_;
  int64_t capacity_;
};

}  // namespace kvtier
