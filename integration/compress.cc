#include "integration/compress.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "kernels/dtype.h"

namespace kvtier {

Result<LayerKeys> ReadLayerKeys(TieredStore* store, SequenceId seq, int layer) {
  const StoreOptions& so = store->options();
  const Geometry& g = so.geometry;
  const int64_t n_sink = so.n_sink, cs = so.chunk_size;
  KVTIER_ASSIGN_OR_RETURN(int64_t n_tokens, store->SequenceLength(seq, layer));
  KVTIER_ASSIGN_OR_RETURN(std::vector<ChunkInfo> chunks, store->ListChunks(seq, layer));
  KVTIER_ASSIGN_OR_RETURN(uint64_t count, store->ChunkCount(seq, layer));
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) of live keys
  ranges.emplace_back(0, std::min<int64_t>(n_sink, n_tokens));
  for (const ChunkInfo& c : chunks) ranges.emplace_back(c.first_token, c.first_token + cs);
  ranges.emplace_back(std::min<int64_t>(n_tokens, n_sink + static_cast<int64_t>(count) * cs), n_tokens);
  LayerKeys out;
  for (const auto& [b, e] : ranges)
    for (int64_t p = b; p < e; ++p) out.positions.push_back(p);
  const size_t n = out.positions.size(), kv_elems = g.token_elems(), tok_bytes = kv_elems * DTypeSize(g.dtype);
  std::vector<uint8_t> raw(n * tok_bytes), raw_v(raw.size());
  size_t at = 0;
  for (const auto& [b, e] : ranges) {
    if (e <= b) continue;
    KVTIER_RETURN_IF_ERROR(
        store->ReadTokens(seq, layer, b, e, raw.data() + at * tok_bytes, raw_v.data() + at * tok_bytes));
    at += static_cast<size_t>(e - b);
  }
  out.keys.resize(n * kv_elems);
  out.values.resize(out.keys.size());
  ToFloat(g.dtype, raw.data(), out.keys.data(), out.keys.size());
  ToFloat(g.dtype, raw_v.data(), out.values.data(), out.values.size());
  out.raw_bytes = raw.size();
  return out;
}

std::vector<uint64_t> ChunksToDrop(const TokenScores& ts, const KeepSet& keep, int64_t n_sink, int chunk_size,
                                   uint64_t n_chunks, int64_t chunk_budget) {
  auto chunk_of = [&](int64_t pos) -> int64_t {
    if (pos < n_sink) return -1;
    const uint64_t c = static_cast<uint64_t>((pos - n_sink) / chunk_size);
    return c < n_chunks ? static_cast<int64_t>(c) : -1;  // -1: a sink or the local window
  };
  std::vector<double> worth(n_chunks, 0.0);
  std::vector<char> kept_any(n_chunks, 0);
  const std::vector<int64_t> kept = keep.Union();
  size_t k = 0;
  for (size_t i = 0; i < ts.positions.size(); ++i) {
    const int64_t pos = ts.positions[i];
    while (k < kept.size() && kept[k] < pos) ++k;
    const int64_t c = chunk_of(pos);
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

Result<uint64_t> KeptTokensPerLayer(const TieredStore& store, SequenceId seq, int layers) {
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
