// ObserveQueries: the representative-key statistics of a layer's local window from queries,
// for an engine that does not compute attention mass itself. Built on TieredStore's public
// calls: the layer step's door for the sinks and local window, AddLocalAttention for the mass.
#pragma once

#include <cstdint>

#include "offload/tiered_store.h"
#include "store/status.h"

namespace kvtier {

/// Computes the attention of q ([m, q_heads, head_dim] fp32, at the given absolute positions)
/// over the sinks and local window of (seq, layer), causal, and adds the mass each local key
/// received to the store's statistics (TieredStore::AddLocalAttention). For the sequence's
/// driver (it goes through BeginLayerStep, which lands the layer's sealed chunks). On a device
/// tier the sinks and window are read back to the host first (at most n_sink + n_local +
/// chunk_size tokens; only prefill windows observe).
Status ObserveQueries(TieredStore& store, SequenceId seq, int layer, const float* q, const int64_t* positions,
                      int m);

}  // namespace kvtier
