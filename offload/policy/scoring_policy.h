// Scoring policies: which keys (tokens) matter, so that the store knows what may leave a
// tier (demotion) or be dropped for good under a budget (compression mode).
//
// One interface for every policy (lru, streaming, h2o, snapkv, hitkv, gkv, structkv,
// compilerkv). A policy is fed, layer by layer, what the attention kernels saw: the softmax
// attention that a window of recent queries gave to the keys currently cached, and
// optionally the keys, values and the queries' token log-probabilities. It keeps whatever
// state it needs across observations (keyed by token position, so it survives the caller
// dropping keys between observations) and answers:
//   - Scores(layer): a score per kv head and cached key (higher = keep);
//   - Keep(layer, budget): the keep set per kv head, exactly min(budget, keys) positions
//     (a policy whose paper keeps fewer says so in its header), and it forgets the state
//     of every position it did not keep, so memory stays bounded by what is cached.
// Chunk scores for tier demotion aggregate token scores over heads and over the tokens of
// a chunk (StructKV's block aggregation S_block = Σ_{t∈block} C[t]); see AggregateToChunks.
//
// Protected keys: the attention sinks (positions < sink_tokens) and the local window (the
// local_tokens most recent cached positions) are kept by every policy and counted in the
// budget; a budget smaller than that is InvalidArgument. Only `streaming` may evict
// protected keys, and says so (it shrinks the local window to fit the budget).
//
// Policies are built from factory strings ("gkv:form=max,alpha=0.8", "hitkv:theta=0.5");
// ToString() gives back a string that rebuilds an identical policy, every parameter
// spelled out. ListScoringPolicies() describes every policy and its defaults.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "store/chunk.h"
#include "store/factory_spec.h"
#include "store/status.h"

namespace kvtier {

/// The model shape a policy scores for, and the keys it must protect.
struct PolicyGeometry {
  int layers = 1;             ///< transformer layers
  int q_heads = 1;            ///< query heads
  int kv_heads = 1;           ///< key/value heads (q_heads % kv_heads == 0, GQA)
  int head_dim = 64;          ///< channels per head
  int64_t sink_tokens = 4;    ///< positions [0, sink_tokens) are attention sinks
  int64_t local_tokens = 32;  ///< the local_tokens most recent cached keys are the local window
  int group_size() const { return q_heads / kv_heads; }
  Status Validate() const;
};

/// What one layer's attention showed for one observation: `n_queries` consecutive recent
/// queries (the observation window; 1 for a decode step) attending over the `n_keys` keys
/// currently cached for that layer. Pointers are borrowed for the duration of Observe().
struct AttentionObservation {
  int layer = 0;
  int n_queries = 0;
  int64_t n_keys = 0;
  /// [n_keys] token positions of the cached keys, strictly increasing.
  const int64_t* key_positions = nullptr;
  /// [n_queries] token positions of the observing queries, strictly increasing. Causal:
  /// a key at a position after a query's gets 0 attention from it.
  const int64_t* query_positions = nullptr;
  /// [q_heads][n_queries][n_keys]: row (h, i) is query i's softmax distribution over the
  /// cached keys for query head h (sums to 1 over the keys at or before the query).
  const float* attention = nullptr;
  /// [n_keys][kv_heads][head_dim] key / value vectors, or nullptr when not supplied.
  const float* keys = nullptr;
  const float* values = nullptr;
  /// [n_queries] log P(x_j | x_<j) of the observing queries' tokens, or nullptr (no model).
  const float* token_logprobs = nullptr;

  /// Shapes, ordering and finiteness of the attention rows; names what is wrong.
  Status Validate(const PolicyGeometry& g) const;
  float at(int q_head, int query, int64_t key) const {
    return attention[(static_cast<size_t>(q_head) * n_queries + query) * n_keys + key];
  }
};

/// One layer's token scores: per kv head, one score per cached key (higher = keep).
struct TokenScores {
  std::vector<int64_t> positions;            ///< the keys scored, increasing
  std::vector<std::vector<float>> per_head;  ///< [kv_heads][positions.size()]
};

/// One layer's keep set.
struct KeepSet {
  std::vector<std::vector<int64_t>> per_head;  ///< [kv_heads] kept positions, increasing
  /// StructKV's structural set I_struct (Eq. 10), for the caller to propagate to deeper
  /// layers if it chooses; empty for every other policy.
  std::vector<int64_t> structural;
  /// Union over heads, increasing: what a store that drops whole tokens must keep.
  std::vector<int64_t> Union() const;
};

/// One parameter of a policy, for `kvtier policies` and the docs.
struct PolicyParam {
  std::string key;
  std::string default_value;
  std::string meaning;
};
struct PolicyInfo {
  std::string name;     ///< factory name
  std::string summary;  ///< one line: what it keeps and why
  std::string source;   ///< paper file / section the equations come from
  std::vector<PolicyParam> params;
};

class ScoringPolicy {
 public:
  virtual ~ScoringPolicy();
  /// Factory name ("gkv").
  virtual std::string name() const = 0;
  /// Factory string with every parameter spelled out; MakeScoringPolicy(ToString())
  /// builds an identical policy.
  virtual std::string ToString() const = 0;
  /// Starts (or restarts) scoring a sequence of this shape; drops all state.
  virtual Status Begin(const PolicyGeometry& g) = 0;
  /// Feeds one layer's observation. Keys the policy has state for but which are absent
  /// from `obs` were dropped by the caller; their state is forgotten. An allocation failure
  /// (state grows with obs.n_keys) is ResourceExhausted naming it; Begin() starts over.
  virtual Status Observe(const AttentionObservation& obs) = 0;
  /// Scores of the keys of the layer's latest observation. FailedPrecondition before any.
  virtual Result<TokenScores> Scores(int layer) const = 0;
  /// The keep set under `budget` tokens per kv head for this layer (see the header
  /// comment); forgets state of every position not kept by any head.
  virtual Result<KeepSet> Keep(int layer, int64_t budget) = 0;
  /// Decode steps between compressions for policies that compress while decoding (G-KV's
  /// s); 0 = compress once, at prefill end.
  virtual int64_t compress_every() const { return 0; }
  /// True only for policies that may evict sinks or the local window (streaming).
  virtual bool may_evict_protected() const { return false; }
  /// Bytes of state held now (for the bounded-memory tests and reports).
  virtual size_t state_bytes() const = 0;
};

/// Every policy with its parameters and defaults, in a stable order.
std::vector<PolicyInfo> ListScoringPolicies();

/// Builds a policy from its factory string. Unknown names, unknown keys and bad values
/// are InvalidArgument naming them.
Result<std::unique_ptr<ScoringPolicy>> MakeScoringPolicy(const std::string& spec);

// ---- helpers shared by the policies --------------------------------------------------

/// The protected keys of a layer (sinks, then the local window) as indexes into
/// `positions` (increasing): positions < g.sink_tokens, and the last g.local_tokens keys.
std::vector<int64_t> ProtectedIndexes(const PolicyGeometry& g, const std::vector<int64_t>& positions);

/// The keep set of one head: every protected index, then the highest-scoring others until
/// `budget` (ties break toward the later position, deterministically), returned as
/// positions, increasing. InvalidArgument if budget < protected count, or if sizes differ.
Result<std::vector<int64_t>> KeepTopWithProtected(const PolicyGeometry& g,
                                                  const std::vector<int64_t>& positions,
                                                  const std::vector<float>& scores, int64_t budget);

/// Indexes of the `k` largest scores among `candidates` (indexes into `scores`), ties
/// toward the larger index; k is clamped to the candidate count. Returned in score order.
std::vector<int64_t> TopIndexes(const std::vector<float>& scores, const std::vector<int64_t>& candidates,
                                int64_t k);

/// Chunk scores by block aggregation (StructKV Sec. 3.5: S_block = Σ_{t∈block} C[t]),
/// summed over kv heads, with the chunks the store cuts (store/chunk.h): chunk c covers
/// positions [n_sink + c*chunk_tokens, n_sink + (c+1)*chunk_tokens), c < n_chunks (the sealed
/// chunks). The sinks (positions < n_sink) and the local window (positions from the end of
/// chunk n_chunks - 1 on) are never chunks: their scores are left out. Returns one (chunk
/// index, score) per chunk that holds at least one scored key, increasing by chunk index;
/// empty when chunk_tokens < 1.
std::vector<std::pair<int64_t, float>> AggregateToChunks(const TokenScores& s, int64_t n_sink,
                                                         int64_t chunk_tokens, uint64_t n_chunks);

/// Carries per-position state from `old_positions` to `new_positions` (both increasing):
/// new[i] = old value at the same position, or `fill` for a position not seen before.
/// Policies use it to keep state keyed by position across observations.
std::vector<float> RemapByPosition(const std::vector<int64_t>& old_positions,
                                   const std::vector<float>& old_values,
                                   const std::vector<int64_t>& new_positions, float fill);

}  // namespace kvtier
