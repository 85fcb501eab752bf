// A layer's hot regions in one place: see offload/store/layer_regions.h.

#include "offload/store/layer_regions.h"

#include <algorithm>

namespace kvtier {
namespace store_internal {

uint64_t LayerRegionBytes(const StoreOptions& o, size_t token_bytes) {
  return 2 * static_cast<uint64_t>(o.n_sink + o.n_local + o.chunk_size) * token_bytes;
}

Status AllocateLayerRegions(const StoreOptions& o, size_t token_bytes, HotTier* hot, LayerState* ls) {
  const size_t ring = static_cast<size_t>(o.n_local + o.chunk_size);
  const size_t sink_bytes = std::max<size_t>(1, static_cast<size_t>(o.n_sink) * token_bytes);
  KVTIER_ASSIGN_OR_RETURN(ls->sink_k, hot->AllocateRegion(sink_bytes));
  KVTIER_ASSIGN_OR_RETURN(ls->sink_v, hot->AllocateRegion(sink_bytes));
  KVTIER_ASSIGN_OR_RETURN(ls->ring_k, hot->AllocateRegion(ring * token_bytes));
  KVTIER_ASSIGN_OR_RETURN(ls->ring_v, hot->AllocateRegion(ring * token_bytes));
  ls->ring_mass.assign(static_cast<size_t>(o.repr_head_count()) * ring, 0.0f);
  return Status::Ok();
}

Status RestoreLayerRegions(const StoreOptions& o, size_t token_bytes, HotTier* hot, std::string_view sinks,
                           std::string_view local, LayerState* ls) {
  const int64_t ring = o.n_local + o.chunk_size;
  const int64_t n_sink_tokens = std::min<int64_t>(ls->n_tokens, o.n_sink);
  const int64_t first_local = std::max<int64_t>(ls->sealed_end, n_sink_tokens);
  const int64_t n_local = ls->n_tokens - first_local;
  const size_t sb = static_cast<size_t>(n_sink_tokens) * token_bytes;
  KVTIER_RETURN_IF_ERROR(hot->Upload(ls->sink_k, sinks.data(), sb));
  KVTIER_RETURN_IF_ERROR(hot->Upload(ls->sink_v, sinks.data() + sb, sb));
  for (int64_t t = 0; t < n_local; ++t) {
    const size_t slot = static_cast<size_t>((first_local + t - o.n_sink) % ring);
    KVTIER_RETURN_IF_ERROR(
        hot->Upload(ls->ring_k + slot * token_bytes, local.data() + t * token_bytes, token_bytes));
    KVTIER_RETURN_IF_ERROR(hot->Upload(ls->ring_v + slot * token_bytes,
                                       local.data() + (n_local + t) * token_bytes, token_bytes));
  }
  return Status::Ok();
}

void FreeLayerRegions(HotTier* hot, LayerState* ls) {
  for (uint8_t** r : {&ls->sink_k, &ls->sink_v, &ls->ring_k, &ls->ring_v}) {
    if (*r != nullptr) hot->FreeRegion(*r, 0);
    *r = nullptr;
  }
}

}  // namespace store_internal
}  // namespace kvtier
