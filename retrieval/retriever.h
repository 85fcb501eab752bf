// Retriever: for each prefill window and each decode step, builds the probe of
// every layer (ProbeBuilder: mean | act | question), scores the layer's chunks
// through its FAISS ChunkIndex, asks the BudgetAllocator (topk | entropy) how
// many chunks the layer may take, and returns the chosen chunk indices. Sinks
// and the local window are always attended on top of them; the caller
// fetches the chunks from the TieredStore (already-hot chunks are hits and
// move nothing) and runs attention.
//
// Layers must be served shallow -> deep within a step (BeginStep, then
// Select for layer 0, 1, ...): the entropy allocator (ActQKV Eq. 12) hands
// what a shallow layer did not use to the deeper ones.
//
// Two index kinds. "Exact" (default) keeps every representative key and
// scores a chunk by its best representative per kv head, summed over heads:
// on the needle workload this finds the needle where a mean over the
// representatives dilutes it (at 32K: needle hit 1.0 vs 0.49). The FAISS
// kinds index one vector per chunk: the mean of its representative keys, kv
// heads concatenated, not normalised, so top-k by inner product is InfLLM's
// score (the sum of q.k over the representatives) and approximate indexes
// (HNSW, IVF) stay sub-linear at millions of tokens.
// With the entropy allocator, scores are ActQKV's Eq. 10 cosines and, as
// Algorithm 1 says, a layer takes its chunks in cosine order (rank_by =
// "logit" takes them by raw inner product instead); with topk the raw inner
// products rank them. head_merge = "max" lets a chunk's most interested kv
// head score it instead of the sum over heads (Exact only).
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "offload/tiered_store.h"
#include "retrieval/budget.h"
#include "retrieval/chunk_index.h"
#include "retrieval/probe.h"

namespace kvtier {

struct RetrieverOptions {
  std::string probe = "act";       ///< probe builder factory string: mean | act | question[:base=..,weight=..]
  std::string alloc = "entropy";   ///< budget allocator factory string: topk | entropy
  /// Chunk index per (sequence, layer): "Exact" (default: every representative
  /// key kept, chunk score = sum over kv heads of the best representative) or
  /// a FAISS factory over one mean vector per chunk ("Flat", "HNSW32", "IVF<n>,Flat").
  ChunkIndexOptions index{.factory = "Exact"};
  int budget_tokens = 2048;        ///< retrieved tokens per layer and step (k = budget_tokens / chunk_size chunks)
  /// "Exact" only: two-stage search. Every chunk is first scored from int8 copies of its
  /// representative keys (half the bytes of fp16 keys; what the allocator sees); the best
  /// max(rerank_factor * take, rerank_min) chunks are then rescored from the keys as stored
  /// (fp32 arithmetic), and the layer takes its chunks in that order. 0 = one such pass over
  /// every chunk.
  int rerank_factor = 4;
  int rerank_min = 256;
  /// "Exact" only: how the per-kv-head scores of a chunk (each head's best representative)
  /// combine. "sum" (default): summed over heads, ActQKV Eq. 10 evaluated per head and
  /// added up, as for the FAISS kinds' concatenated vectors. "max": the most interested
  /// head decides. Attention is per head: a chunk one head needs badly (an induction head
  /// copying the needle) matters even when the other heads ignore it, and under "sum" their
  /// indifference drowns it (kvtier-llama passkey at 2K, 4x past its training length:
  /// docs/retrieval.md).
  std::string head_merge = "sum";
  /// Allocators that score every chunk (entropy): the order a layer takes its B^ℓ chunks in.
  /// "cosine" (default): ActQKV Algorithm 1, by the Eq. 10 cosines the budget came from.
  /// "logit": by the raw probe.key inner product, the attention logit, which keeps key
  /// norms: a chunk whose key is long gets more attention than its cosine says. The budget
  /// B^ℓ (Eq. 10-12) is computed from cosines either way. (topk always ranks by the logit.)
  std::string rank_by = "cosine";
  Status Validate() const;
};

/// What Select chose for one layer.
struct LayerSelection {
  std::vector<uint64_t> chunks;    ///< chunk indices to attend, best first
  double probe_ms = 0, search_ms = 0, alloc_ms = 0;
  double entropy = 0;              ///< Θ^ℓ when the allocator computed it (entropy), else 0
};

class Retriever {
 public:
  static Result<std::unique_ptr<Retriever>> Create(TieredStore* store, const RetrieverOptions& options);

  /// Starts a step (a prefill window or a decode token) over all layers.
  void BeginStep();
  /// Chooses the chunks of one layer. q: [m, q_heads, head_dim] fp32, the
  /// window's queries (m >= 1), or the current token's query when `decode`.
  Result<LayerSelection> Select(SequenceId seq, int layer, const float* q, int m, bool decode);
  /// Feeds a prefill window to the probe builder without retrieving (keeps
  /// ActQKV's running statistics of Eq. 8 over every window).
  Status Observe(int layer, const float* q, int m);
  /// Observe() plus the scores (summed cosines) of every indexed chunk of
  /// (seq, layer) for this window's probe, in chunk order. For analysis:
  /// probe-to-oracle agreement.
  Status ObserveAndScore(SequenceId seq, int layer, const float* q, int m, std::vector<uint64_t>* ids,
                         std::vector<float>* scores);
  /// Sets the task question for a question-aware probe (Q-LLM).
  Status SetQuestion(int layer, const float* q, int m);
  /// Indexes chunks sealed since the last call (also rebuilds after a reopen).
  Status Sync(SequenceId seq, int layer);
  /// Removes chunks from (seq, layer)'s index: call after TieredStore::DropChunks so
  /// dropped chunks are never selected again. Unknown indices are ignored.
  Status Forget(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices);

  ProbeBuilder& probe() { return *probe_; }
  const RetrieverOptions& options() const { return options_; }
  uint64_t memory_bytes() const;
  std::string Describe() const;  ///< "probe=act alloc=entropy index=Flat k=64"

 private:
  Retriever(TieredStore* store, const RetrieverOptions& options) : store_(store), options_(options) {}
  struct LayerIndex {
    std::unique_ptr<ChunkIndex> index;
    uint64_t next_chunk = 0;  // chunks below this index are indexed (or holes)
    std::vector<float> norm;  // [chunk index] L2 norm of the chunk's vector (for Eq. 10 cosines)
    // "Exact": every representative key, and its inverse norm per head.
    std::vector<uint64_t> exact_ids;                // [n] chunk index of each row
    std::vector<std::vector<uint8_t>> exact_repr;   // [H][n, R, D] in the store's dtype (the chunk's own values,
                                                    // nothing lost): per head, so one head's keys are contiguous
    std::vector<std::vector<float>> exact_inv_norm; // [H][n, R]
    // The first search stage's int8 codes of the same rows, per head, in blocks of kernels::kI8Block
    // lanes (see DotI8Blocks): block g*R + r holds representative r of chunks [8g, 8g+8), one chunk
    // per lane, so a chunk's best representative is an element-wise max over R consecutive blocks.
    std::vector<std::vector<int8_t>> exact_q8;           // [H]
    std::vector<std::vector<float>> exact_q8_scale;      // [H][block * 8 + lane]: the row's code scale (0 in padding)
    std::vector<std::vector<float>> exact_q8_cos_scale;  // [H][block * 8 + lane]: code scale times inverse norm
  };
  Result<LayerIndex*> Index(SequenceId seq, int layer);
  bool exact() const { return options_.index.factory == "Exact"; }
  // "Exact" scores of every chunk: raw = sum_h max_r <p_h, r_h> (InfLLM's
  // q.k, best representative per head); cos = mean_h max_r cos(p_h, r_h)
  // (ActQKV Eq. 10 per head, in [-1, 1]).
  void ExactScores(const LayerIndex& li, const float* probe, std::vector<float>* raw, std::vector<float>* cos) const;
  // The same two scores for the chunks at rows `rows` only (the rerank stage).
  void ExactScoresOf(const LayerIndex& li, const float* probe, const std::vector<int64_t>& rows,
                     std::vector<float>* raw, std::vector<float>* cos) const;
  // Writes representative r of the chunk at row `row` into head h's int8 blocks, from its fp32 key.
  static void PutQuantizedRow(LayerIndex* li, int h, size_t row, int r, int R, const float* key, int D, float inv_norm);
  // First stage: ExactScores from the int8 codes.
  void QuantizedScores(const LayerIndex& li, const float* probe, std::vector<float>* raw, std::vector<float>* cos) const;

  TieredStore* store_;
  RetrieverOptions options_;
  std::unique_ptr<ProbeBuilder> probe_;
  std::unique_ptr<BudgetAllocator> alloc_;
  std::unordered_map<uint64_t, LayerIndex> indexes_;  // key: seq * 65536 + layer
  std::vector<float> repr_, probe_buf_, probe_vec_;
  std::vector<uint64_t> ids_;
  std::vector<int64_t> rows_;
  std::vector<uint32_t> rank_keys_;  // Select: scratch, the first-stage scores' order keys
  std::vector<float> scores_;
  int k_ = 0;
};

}  // namespace kvtier
