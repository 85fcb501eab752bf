// TieredStore, part "layer step": the door a sequence's driver goes through once per layer
// step (BeginLayerStep). A decode layer step makes two store visits and three lock entries:
//   1. BeginLayerStep: under one lock entry, lands the layer's own sealed chunks (nothing to
//      do in the steady state), reads the sticky background error, the hot view (sinks and
//      local window) and the layer's chunk updates since the retrieval index's cursor;
//   2. FetchChunks of the chosen chunks: one lock entry; its handle's Wait takes no lock
//      when every chunk was hot already;
//   3. FetchHandle::Release after attention: one lock entry.
// tests/offload/layer_step_test.cc counts them.
//
// Locking: the coordinator's mutex (sync_.mu) for all of it; the hot view reads the layer's sinks
// and ring, which belong to the driver (the caller). The updates may drop the lock to read
// representatives back from the lower tiers (the first sync after a reopen), as
// ChunkUpdatesSince does.

#include "offload/store_state.h"
#include "offload/tiered_store.h"

namespace kvtier {

Status TieredStore::BeginLayerStep(SequenceId seq, int layer, const ChunkCursor* since, ChunkUpdate* updates,
                                   LayerStepView* out, size_t max_added, LandRule land) {
  visits_.Count();
  if (out == nullptr) return InvalidArgument("BeginLayerStep: out must not be null");
  if (since != nullptr && updates == nullptr)
    return InvalidArgument("BeginLayerStep: updates must not be null when a cursor is given");
  if (max_added == 0) return InvalidArgument("BeginLayerStep: max_added must be > 0");
  std::unique_lock<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
  // The caller drives the sequence: the layer's own sealed chunks land now (see "Landing"), or,
  // for a step that must not wait, those complete, the rest listed.
  out->sealing.clear();
  if (land == LandRule::kCompleteOnly) {
    landing_->LandLayer(l, s, layer, 0, /*only_complete=*/true);
    if (s->layers[layer].landers > 0) landing_->LandLayer(l, s, layer);  // claimed elsewhere: in neither list
    landing_->ListLanding(s->layers[layer], &out->sealing);
  } else {
    landing_->LandLayer(l, s, layer);
  }
  KVTIER_RETURN_IF_ERROR(Landing::TakeError(s->layers[layer]));
  out->background = lower_.BackgroundErrorLocked();
  KVTIER_RETURN_IF_ERROR(ring_->View(seq, s->layers[layer], &out->hot));
  if (since == nullptr) return Status::Ok();
  return catalog_->UpdatesSince(l, sync_, lower_, s, layer, *since, updates, max_added);
}

Result<HotView> GetHotView(TieredStore& store, SequenceId seq, int layer) {
  LayerStepView step;
  KVTIER_RETURN_IF_ERROR(store.BeginLayerStep(seq, layer, nullptr, nullptr, &step));
  return step.hot;
}

}  // namespace kvtier
