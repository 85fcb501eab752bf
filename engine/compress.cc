#include "engine/compress.h"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "kernels/cpu/dot.h"
#include "kernels/dtype.h"
#include "kernels/tbb_tsan.h"

namespace kvtier {

Result<LayerKeys> ReadLayerKeys(TieredStore* store, SequenceId seq, int layer) {
  return ReturnOnBadAlloc(
      [&] { return "ReadLayerKeys: the keys and values of layer " + std::to_string(layer); },
      [&]() -> Result<LayerKeys> {
        const StoreOptions& so = store->options();
        const Geometry& g = so.geometry;
        const int64_t n_sink = so.n_sink, cs = so.chunk_size;
        KVTIER_ASSIGN_OR_RETURN(int64_t n_tokens, store->SequenceLength(seq, layer));
        KVTIER_ASSIGN_OR_RETURN(std::vector<ChunkInfo> chunks, store->ListChunks(seq, layer));
        KVTIER_ASSIGN_OR_RETURN(uint64_t count, store->ChunkCount(seq, layer));
        std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) of live keys
        ranges.emplace_back(0, std::min<int64_t>(n_sink, n_tokens));
        for (const ChunkInfo& c : chunks) ranges.emplace_back(c.first_token, c.first_token + cs);
        ranges.emplace_back(std::min<int64_t>(n_tokens, ChunkFirstToken(count, n_sink, cs)), n_tokens);
        LayerKeys out;
        for (const auto& [b, e] : ranges)
          for (int64_t p = b; p < e; ++p) out.positions.push_back(p);
        const size_t n = out.positions.size(), kv_elems = g.token_elems(),
                     tok_bytes = kv_elems * DTypeSize(g.dtype);
        std::vector<uint8_t> raw(n * tok_bytes), raw_v(raw.size());
        size_t at = 0;
        for (const auto& [b, e] : ranges) {
          if (e <= b) continue;
          KVTIER_RETURN_IF_ERROR(store->ReadTokens(seq, layer, b, e, raw.data() + at * tok_bytes,
                                                   raw_v.data() + at * tok_bytes));
          at += static_cast<size_t>(e - b);
        }
        out.keys.resize(n * kv_elems);
        out.values.resize(out.keys.size());
        ToFloat(g.dtype, raw.data(), out.keys.data(), out.keys.size());
        ToFloat(g.dtype, raw_v.data(), out.values.data(), out.values.size());
        out.raw_bytes = raw.size();
        return out;
      });
}

Result<int64_t> ChunkBudget(TieredStore& store, SequenceId seq, int layer, int64_t kv_budget) {
  const StoreOptions& so = store.options();
  KVTIER_ASSIGN_OR_RETURN(int64_t n_tokens, store.SequenceLength(seq, layer));
  KVTIER_ASSIGN_OR_RETURN(uint64_t n_chunks, store.ChunkCount(seq, layer));
  // What the store holds outside the sealed chunks: the sinks (fewer early on) and the local
  // window from the sealed end on (n_local to n_local + chunk_size tokens once chunks seal).
  const int64_t sinks = std::min<int64_t>(so.n_sink, n_tokens);
  const int64_t local =
      n_tokens - std::min<int64_t>(n_tokens, ChunkFirstToken(n_chunks, so.n_sink, so.chunk_size));
  return std::max<int64_t>(0, (kv_budget - sinks - local) / so.chunk_size);
}

std::vector<uint64_t> ChunksToDrop(const TokenScores& ts, const KeepSet& keep, int64_t n_sink, int chunk_size,
                                   uint64_t n_chunks, int64_t chunk_budget) {
  std::vector<double> worth(n_chunks, 0.0);
  std::vector<char> kept_any(n_chunks, 0);
  const std::vector<int64_t> kept = keep.Union();
  size_t k = 0;
  for (size_t i = 0; i < ts.positions.size(); ++i) {
    const int64_t pos = ts.positions[i];
    while (k < kept.size() && kept[k] < pos) ++k;
    const int64_t c = ChunkOfPosition(pos, n_sink, chunk_size, n_chunks);  // -1: a sink or the local window
    if (k == kept.size() || kept[k] != pos || c < 0) continue;
    kept_any[c] = 1;
    for (const auto& head : ts.per_head) worth[c] += head[i];
  }
  std::vector<uint64_t> order(n_chunks);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) {
    if (kept_any[a] != kept_any[b]) return kept_any[a] > kept_any[b];
    if (worth[a] != worth[b]) return worth[a] > worth[b];
    return a < b;
  });
  std::vector<uint64_t> drop;
  for (size_t i = 0; i < order.size(); ++i)
    if (static_cast<int64_t>(i) >= chunk_budget || !kept_any[order[i]]) drop.push_back(order[i]);
  std::sort(drop.begin(), drop.end());
  return drop;
}

void ExactAttentionRows(const Geometry& g, const float* q, const int64_t* qpos, int m, const float* k,
                        const int64_t* key_pos, int64_t n_keys, float* out) {
  const int Hq = g.q_heads, D = g.head_dim, G = g.group_size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t tok = static_cast<size_t>(g.kv_heads) * D;
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(0, Hq * m, fj.Body([&](int hi) {
    const int h = hi / m, i = hi % m;
    const float* qv = q + (static_cast<size_t>(i) * Hq + h) * D;
    float* row = out + (static_cast<size_t>(h) * m + i) * n_keys;
    const int64_t visible = key_pos ? std::upper_bound(key_pos, key_pos + n_keys, qpos[i]) - key_pos
                                    : std::min<int64_t>(n_keys, qpos[i] + 1);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < visible; ++t) {
      row[t] = kernels::Dot(qv, k + static_cast<size_t>(t) * tok + static_cast<size_t>(h / G) * D, D) * scale;
      mx = std::max(mx, row[t]);
    }
    double sum = 0.0;
    for (int64_t t = 0; t < visible; ++t) sum += (row[t] = std::exp(row[t] - mx));
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t t = 0; t < visible; ++t) row[t] *= inv;
    std::fill(row + std::max<int64_t>(visible, 0), row + n_keys, 0.0f);
  }));
  fj.Join();
}

Result<uint64_t> KeptTokensPerLayer(TieredStore& store, SequenceId seq, int layers) {
  const uint64_t cs = static_cast<uint64_t>(store.options().chunk_size);
  uint64_t total = 0;
  for (int l = 0; l < layers; ++l) {
    KVTIER_ASSIGN_OR_RETURN(int64_t n_tokens, store.SequenceLength(seq, l));
    KVTIER_ASSIGN_OR_RETURN(uint64_t count, store.ChunkCount(seq, l));
    KVTIER_ASSIGN_OR_RETURN(std::vector<ChunkInfo> live, store.ListChunks(seq, l));
    total += static_cast<uint64_t>(n_tokens) - (count - live.size()) * cs;
  }
  return total / static_cast<uint64_t>(std::max(layers, 1));
}

}  // namespace kvtier
