// KV compression of a TieredStore sequence by a ScoringPolicy, in whole chunks: the
// pieces `kvtier run --compress` (synthetic or traced K/V) and `kvtier infinite
// --compress` (the real model's own store) share.
//
//   KVTIER_ASSIGN_OR_RETURN(LayerKeys keys, ReadLayerKeys(store, seq, layer));
//   ... exact attention of the observed queries over keys.keys -> policy->Observe(...)
//   KVTIER_ASSIGN_OR_RETURN(TokenScores ts, policy->Scores(layer));
//   KVTIER_ASSIGN_OR_RETURN(KeepSet keep, policy->Keep(layer, kv_budget));
//   KVTIER_ASSIGN_OR_RETURN(int64_t chunk_budget, ChunkBudget(*store, seq, layer, kv_budget));
//   std::vector<uint64_t> drop = ChunksToDrop(ts, keep, n_sink, chunk_size, n_chunks, chunk_budget);
//   store->DropChunks(seq, layer, drop);  // every Retriever over seq drops them at its next Sync
//
// A store drops whole chunks, a policy keeps tokens: a chunk's worth is the policy's score
// summed over the tokens of it the policy kept (so the keep decision counts, not only the
// ranking); chunks it kept nothing of leave, and of the others the `chunk_budget` worthiest
// stay. Sinks and the local window are never chunks and always stay.
#pragma once

#include <cstdint>
#include <vector>

#include "offload/policy/scoring_policy.h"
#include "offload/tiered_store.h"
#include "store/status.h"

namespace kvtier {

/// Every key a layer still holds, in position order, as fp32.
struct LayerKeys {
  std::vector<int64_t> positions;   ///< increasing: sinks, live sealed chunks, local window
  std::vector<float> keys, values;  ///< [positions.size()][kv_heads][head_dim], as stored
  size_t raw_bytes = 0;             ///< bytes of the keys in the store's dtype (the values take as many)
};

/// Reads back every key and value of (seq, layer) the store still holds: the sinks, the live
/// sealed chunks (dropped ones are holes and skipped) and the local window, from whichever
/// tier holds them. Keys are as stored (before RoPE for a model in InfLLM position mode).
Result<LayerKeys> ReadLayerKeys(TieredStore* store, SequenceId seq, int layer);

/// Sealed chunks (seq, layer) may keep under `kv_budget` tokens per layer: what the sinks and
/// the local window, as the store holds them now, leave of the budget, in whole chunks, so the
/// layer never holds more than kv_budget tokens. The one exception: the local window holds
/// n_local to n_local + chunk_size tokens (a partly filled chunk waits there) and compression
/// drops only sealed chunks, so a budget below n_sink + n_local + chunk_size may leave the
/// sinks and local window alone over it; the chunk budget is then 0. Both `kvtier run
/// --compress` and `kvtier infinite --compress` size their compression with this.
Result<int64_t> ChunkBudget(TieredStore& store, SequenceId seq, int layer, int64_t kv_budget);

/// Sealed chunks of one layer to drop so that at most `chunk_budget` remain, given the policy's
/// token scores and keep set for the layer. Chunk i covers positions [n_sink + i*chunk_size,
/// n_sink + (i+1)*chunk_size), i < n_chunks (chunks already dropped have no scored tokens, so
/// they are simply listed again: DropChunks ignores holes). Ties in worth go to the earlier
/// chunk. Returned in increasing order.
std::vector<uint64_t> ChunksToDrop(const TokenScores& scores, const KeepSet& keep, int64_t n_sink,
                                   int chunk_size, uint64_t n_chunks, int64_t chunk_budget);

/// Exact causal softmax attention of `m` queries (q: [m][q_heads][head_dim], at increasing
/// positions qpos) over `n_keys` keys (k: [n_keys][kv_heads][head_dim]) at the increasing
/// positions key_pos (nullptr = positions 0..n_keys-1), scaled by 1/sqrt(head_dim); out:
/// [q_heads][m][n_keys], 0 for keys after a query. Rows are split over the cores. What a
/// policy observes.
void ExactAttentionRows(const Geometry& g, const float* q, const int64_t* qpos, int m, const float* k,
                        const int64_t* key_pos, int64_t n_keys, float* out);

/// Tokens the store holds for the sequence, per layer, mean over `layers` layers (integer
/// division): appended tokens less the dropped chunks' tokens.
Result<uint64_t> KeptTokensPerLayer(TieredStore& store, SequenceId seq, int layers);

}  // namespace kvtier
