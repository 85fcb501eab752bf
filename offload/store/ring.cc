// TieredStore, the appends: Append copies K/V into a layer's sinks and ring (LayerRing) and
// seals the ring's oldest chunk when it is full (Landing::Seal); AddLocalAttention adds the
// attention mass the ring's tokens received (the statistics a sealed chunk's representatives
// are chosen from; offload/observe_queries.h computes it from queries).
//
// Locking: the sinks, the ring and its mass belong to the sequence's driving thread, one at a
// time, and are touched without the mutex; Append holds Sequence::busy while it copies so a
// drop waits for it.

#include "offload/store_state.h"
#include "offload/tiered_store.h"

namespace kvtier {

Status TieredStore::Append(SequenceId seq, int layer, const void* k, const void* v, int n, DType dtype,
                           MemorySpace space, bool ordered) {
  visits_.Count();
  Sequence* s = nullptr;
  {
    std::unique_lock<CountingMutex> l(sync_.mu);
    KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, true, &s));
    if (n <= 0) return InvalidArgument("Append: token count must be > 0 (got " + std::to_string(n) + ")");
    if (k == nullptr || v == nullptr) return InvalidArgument("Append: k and v must not be null");
    if (dtype != options_.geometry.dtype)
      return InvalidArgument(std::string("Append: dtype ") + DTypeName(dtype) +
                             " does not match the store's " + DTypeName(options_.geometry.dtype));
    if (space != MemorySpace::kHost && space != MemorySpace::kDevice)
      return InvalidArgument("Append: unknown memory space " + std::to_string(static_cast<int>(space)) +
                             " (kHost or kDevice)");
    // Chunks sealed by earlier Appends whose downloads are complete land now (never waiting);
    // a failed one is reported here, before anything is appended.
    landing_->LandLayer(l, s, layer, 0, true);
    KVTIER_RETURN_IF_ERROR(Landing::TakeError(s->layers[layer]));
    // A lower tier that failed a background write: say so now, before appending anything,
    // rather than after waiting for warm room behind it.
    KVTIER_RETURN_IF_ERROR(lower_.BackgroundErrorLocked());
    s->busy++;
  }
  // kDevice K/V are already in the tier's memory space: copied within it, never through the host.
  HotTier* hot = hot_.get();
  const LayerRing::CopyIn copy_in = [hot, space, ordered](uint8_t* dst, const uint8_t* src, size_t bytes) {
    // The engine's host K/V are staged before the call returns; the tier's later work (the
    // attention, a seal's download) is ordered after the copy, so nothing waits for it here.
    if (space == MemorySpace::kHost) return hot->UploadOrdered(dst, src, bytes);
    return ordered ? hot->CopyWithinOrdered(dst, src, bytes) : hot->CopyWithin(dst, src, bytes);
  };
  const Status status = ring_->Append(
      s->layers[layer], static_cast<const uint8_t*>(k), static_cast<const uint8_t*>(v), n, copy_in,
      [&] { return ReturnOnBadAlloc("Append: sealing a chunk", [&] { return landing_->Seal(s, layer); }); });
  std::lock_guard<CountingMutex> l(sync_.mu);
  s->busy--;
  sync_.cv.notify_all();
  return status;
}

Status TieredStore::AddLocalAttention(SequenceId seq, int layer, int64_t first_position, int n,
                                      const float* mass) {
  if (options_.repr_heads == ReprHeads::kQuery)
    return FailedPrecondition(
        "AddLocalAttention: this store's representatives are per query head (repr_heads=query) and "
        "need each query head's mass ([q_heads, n]: AddLocalQueryAttention), not a kv head's sum");
  return AddMass(seq, layer, first_position, n, mass);
}

Status TieredStore::AddLocalQueryAttention(SequenceId seq, int layer, int64_t first_position, int n,
                                           const float* mass) {
  if (options_.repr_heads != ReprHeads::kQuery)
    return FailedPrecondition(
        "AddLocalQueryAttention: this store's representatives are per kv head (repr_heads=kv): "
        "give the mass summed over each kv head's query heads (AddLocalAttention)");
  return AddMass(seq, layer, first_position, n, mass);
}

Status TieredStore::AddMass(SequenceId seq, int layer, int64_t first_position, int n, const float* mass) {
  visits_.Count();
  Sequence* s = nullptr;
  {
    std::lock_guard<CountingMutex> l(sync_.mu);
    KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, true, &s));
  }
  return ring_->AddMass(s->layers[layer], first_position, n, mass);
}

}  // namespace kvtier
