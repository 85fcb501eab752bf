// ExactRetriever: the foundation's chunk selection, exact top-k by dot product
// of a probe query against every chunk's representative keys. A chunk's score
// is the sum over kv heads of its best-matching representative key:
//   score(c) = sum_h max_r <probe_h, repr_{c,r,h}>
// (InfLLM scores a chunk by its representatives; taking the best one keeps a
// single needle token from being averaged away). The FAISS index and the
// ActQKV probe replace this in the retrieval work; this class stays as the
// exact reference they are checked against.
#pragma once

#include <cstdint>
#include <vector>

#include "offload/tiered_store.h"

namespace kvtier {

class ExactRetriever {
 public:
  explicit ExactRetriever(TieredStore* store) : store_(store) {}

  /// Picks up representatives of chunks sealed since the last call.
  Status Sync(SequenceId seq, int layer);

  /// Top `k` chunk indices of (seq, layer) for `probe` ([kv_heads, head_dim]
  /// fp32), best first; ties go to the older chunk. Fewer when fewer exist.
  Result<std::vector<uint64_t>> TopK(SequenceId seq, int layer, const float* probe, int k,
                                     std::vector<float>* scores = nullptr);

  /// InfLLM's probe: mean of m queries ([m, q_heads, head_dim]) over the
  /// queries and the q heads of each GQA group -> [kv_heads, head_dim].
  static void MeanProbe(const Geometry& g, const float* q, int m, float* probe);

  uint64_t memory_bytes() const;

 private:
  struct LayerIndex {
    std::vector<uint64_t> chunk_index;  // [n] chunk index of each row
    std::vector<float> repr;            // [n, repr_topk, kv_heads, head_dim]
    uint64_t next_chunk = 0;            // chunks below this index are indexed (or holes)
  };
  LayerIndex& Layer(SequenceId seq, int layer);

  TieredStore* store_;
  std::vector<std::pair<std::pair<SequenceId, int>, LayerIndex>> layers_;
};

}  // namespace kvtier
