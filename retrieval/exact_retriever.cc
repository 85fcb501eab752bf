#include "retrieval/exact_retriever.h"

#include "kernels/cpu/dot.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <limits>
#include <numeric>

namespace kvtier {
using kernels::Dot;

ExactRetriever::LayerIndex& ExactRetriever::Layer(SequenceId seq, int layer) {
  for (auto& [key, idx] : layers_)
    if (key.first == seq && key.second == layer) return idx;
  layers_.push_back({{seq, layer}, LayerIndex{}});
  return layers_.back().second;
}

Status ExactRetriever::Sync(SequenceId seq, int layer) {
  KVTIER_ASSIGN_OR_RETURN(uint64_t count, store_->ChunkCount(seq, layer));
  LayerIndex& idx = Layer(seq, layer);
  const StoreOptions& o = store_->options();
  const size_t row = static_cast<size_t>(o.repr_topk) * o.geometry.token_elems();
  for (uint64_t i = idx.next_chunk; i < count; ++i) {
    const ChunkKey key{seq, static_cast<uint32_t>(layer), i};
    idx.repr.resize((idx.chunk_index.size() + 1) * row);
    Status st = store_->GetRepresentatives(key, idx.repr.data() + idx.chunk_index.size() * row);
    if (st.code() == StatusCode::kNotFound) continue;  // a hole left by a crash: nothing to index
    KVTIER_RETURN_IF_ERROR(st);
    idx.chunk_index.push_back(i);
  }
  idx.repr.resize(idx.chunk_index.size() * row);
  idx.next_chunk = count;
  return Status::Ok();
}

Result<std::vector<uint64_t>> ExactRetriever::TopK(SequenceId seq, int layer, const float* probe, int k,
                                                   std::vector<float>* scores_out) {
  if (probe == nullptr) return InvalidArgument("TopK: probe must not be null");
  if (k < 0) return InvalidArgument("TopK: k must be >= 0 (got " + std::to_string(k) + ")");
  KVTIER_RETURN_IF_ERROR(Sync(seq, layer));
  const LayerIndex& idx = Layer(seq, layer);
  const StoreOptions& o = store_->options();
  const int H = o.geometry.kv_heads, D = o.geometry.head_dim, R = o.repr_topk;
  const size_t n = idx.chunk_index.size();
  std::vector<float> score(n);
  // Chunks score independently: split them over the cores.
  tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 256), [&](const tbb::blocked_range<size_t>& range) {
    for (size_t c = range.begin(); c < range.end(); ++c) {
      const float* rows = idx.repr.data() + c * R * H * D;
      float total = 0.0f;
      for (int h = 0; h < H; ++h) {
        float best = -std::numeric_limits<float>::infinity();
        for (int r = 0; r < R; ++r)
          best = std::max(best, Dot(rows + (static_cast<size_t>(r) * H + h) * D, probe + static_cast<size_t>(h) * D, D));
        total += best;
      }
      score[c] = total;
    }
  });
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  const size_t take = std::min<size_t>(n, static_cast<size_t>(k));
  std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](size_t a, size_t b) {
    return score[a] != score[b] ? score[a] > score[b] : a < b;
  });
  std::vector<uint64_t> out(take);
  for (size_t i = 0; i < take; ++i) out[i] = idx.chunk_index[order[i]];
  if (scores_out) *scores_out = std::move(score);
  return out;
}

void ExactRetriever::MeanProbe(const Geometry& g, const float* q, int m, float* probe) {
  const int G = g.group_size(), D = g.head_dim;
  std::fill_n(probe, static_cast<size_t>(g.kv_heads) * D, 0.0f);
  const float w = 1.0f / static_cast<float>(m * G);
  for (int i = 0; i < m; ++i)
    for (int h = 0; h < g.q_heads; ++h) {
      const float* src = q + (static_cast<size_t>(i) * g.q_heads + h) * D;
      float* dst = probe + static_cast<size_t>(h / G) * D;
      for (int d = 0; d < D; ++d) dst[d] += w * src[d];
    }
}

uint64_t ExactRetriever::memory_bytes() const {
  uint64_t b = 0;
  for (auto& [key, idx] : layers_) b += idx.repr.capacity() * sizeof(float) + idx.chunk_index.capacity() * 8;
  return b;
}

}  // namespace kvtier
