// ObserveQueries: the representative-key statistics of a layer's local window from queries,
// for an engine that does not compute attention mass itself. Built on TieredStore's public
// calls: the layer step's door for the sinks and local window, AddLocalAttention (or
// AddLocalQueryAttention) for the mass.
#pragma once

#include <cstdint>
#include <vector>

#include "offload/tiered_store.h"
#include "store/status.h"

namespace kvtier {

/// Computes the attention of q ([m, q_heads, head_dim] fp32, at the given absolute positions)
/// over the sinks and local window of (seq, layer), causal, and adds the mass each local key
/// received to the store's statistics: per kv head (TieredStore::AddLocalAttention), or per
/// query head where the store keeps representatives per query head (ReprHeads::kQuery:
/// AddLocalQueryAttention; one attention pass per member of a GQA group). For the sequence's
/// driver (it goes through BeginLayerStep, which lands the layer's sealed chunks). On a device
/// tier the sinks and window are read back to the host first (at most n_sink + n_local +
/// chunk_size tokens; only prefill windows observe).
Status ObserveQueries(TieredStore& store, SequenceId seq, int layer, const float* q, const int64_t* positions,
                      int m);

/// The attention of q ([m, q_heads, head_dim] fp32, causal at `positions`) over `parts` (part 0
/// the sinks, whose mass is not kept; parts 1.. the local window's runs, keys and values in
/// `dtype`, already where the model attends them), on the host, and the mass each local key
/// received added to the store's statistics: per kv head (AddLocalAttention) or, for a store
/// whose representatives are per query head, per query head (AddLocalQueryAttention; one pass
/// per member of a GQA group). `what` prefixes the errors. The parts' own mass pointers are
/// ignored.
Status AddWindowMass(TieredStore& store, SequenceId seq, int layer, DType dtype, const float* q,
                     const int64_t* positions, int m, std::vector<kernels::KvSpan> parts, const char* what);

/// For a host pass over a hot view: on a device tier, downloads the sinks and local window of
/// `view` (`token_bytes` per token, K or V) into `storage` and points the view's spans at the
/// copies (positions unchanged); on a host tier, leaves the view as it is.
Status HostCopyOfView(HotTier* hot, size_t token_bytes, HotView* view,
                      std::vector<std::vector<uint8_t>>* storage);

}  // namespace kvtier
