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

namespace kvtier {

using SequenceId = uint64_t;

/// Identity of a chunk: (sequence, layer, index within that layer).
struct ChunkKey {
  SequenceId seq = 0;   ///< sequence id
  uint32_t layer = 0;   ///< layer index
  uint64_t index = 0;   ///< 0 for the first chunk after the sinks
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
    h ^= h >> 31; h *= 0xbf58476d1ce4e5b9ull; h ^= h >> 29;
    return static_cast<size_t>(h);
  }
};

/// Tier bit flags: a chunk may be resident in several tiers at once
/// (the hot slot is a cache of the warm copy; a written-through chunk is
/// warm and cold).
enum TierBits : uint8_t { kTierNone = 0, kTierHot = 1, kTierWarm = 2, kTierCold = 4 };

}  // namespace kvtier
