// Chunks: fixed-size runs of tokens that have left the local window.
//
// A chunk holds K and V of `chunk_size` tokens of one (sequence, layer) for all
// kv heads, laid out as [K: chunk_size x kv_heads x head_dim][V: same], in the
// storage dtype. Its metadata (token range, representative keys, scores, where
// it lives) stays in memory and in the cold tier's meta records.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvtier/types.h"

namespace kvtier {

/// Identity of a chunk: (sequence, layer, index within that layer).
struct ChunkKey {
  SequenceId seq = 0;  ///< sequence id
  uint32_t layer = 0;  ///< layer index
  uint64_t index = 0;  ///< 0 for the first chunk after the sinks
  bool operator==(const ChunkKey& o) const { return seq == o.seq && layer == o.layer && index == o.index; }
  bool operator<(const ChunkKey& o) const {
    if (seq != o.seq) return seq < o.seq;
    if (layer != o.layer) return layer < o.layer;
    return index < o.index;
  }
  std::string ToString() const;  ///< "seq=3/layer=1/chunk=17"
};

struct ChunkKeyHash {
  size_t operator()(const ChunkKey& k) const {
    uint64_t h = k.seq * 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(k.layer) << 40) ^ k.index;
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    return static_cast<size_t>(h);
  }
};

// ---- where chunks sit in a layer's token positions ----------------------------------
// The store cuts a layer as [sinks: 0, n_sink) [chunk 0] [chunk 1] ... [local window]:
// chunk i covers [n_sink + i*chunk_size, n_sink + (i+1)*chunk_size), and the local window
// starts where the last sealed chunk ends. Sinks and the local window are never chunks.
// Every piece of code that maps a position to a chunk or back uses these two functions.

/// Bound for ChunkOfPosition when every position past the sinks lies in some chunk (a
/// caller that has already checked the position is below the sealed end).
inline constexpr uint64_t kAnyChunkCount = ~uint64_t{0};

/// Index of the chunk holding token position `pos`, given `n_chunks` sealed chunks; -1 for a
/// sink (pos < n_sink) or a position in the local window (at or past the sealed chunks' end).
/// chunk_size must be > 0.
constexpr int64_t ChunkOfPosition(int64_t pos, int64_t n_sink, int64_t chunk_size, uint64_t n_chunks) {
  if (pos < n_sink) return -1;
  const uint64_t c = static_cast<uint64_t>((pos - n_sink) / chunk_size);
  return c < n_chunks ? static_cast<int64_t>(c) : -1;
}

/// First token position of chunk `index`: n_sink + index * chunk_size. With index = the
/// number of sealed chunks it is where the local window begins (the sealed end).
constexpr int64_t ChunkFirstToken(uint64_t index, int64_t n_sink, int64_t chunk_size) {
  return n_sink + static_cast<int64_t>(index) * chunk_size;
}

/// Tier bit flags: a chunk may be resident in several tiers at once
/// (the hot slot is a cache of the warm copy; a written-through chunk is
/// warm and cold).
enum TierBits : uint8_t { kTierNone = 0, kTierHot = 1, kTierWarm = 2, kTierCold = 4, kTierRemote = 8 };

}  // namespace kvtier
