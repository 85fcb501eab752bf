// Deterministic KV byte patterns for verification: the expected bytes of any
// (sequence, layer, position) can be recomputed anywhere (a stress thread, a
// crash-test parent, a benchmark), so a read can be checked bit for bit
// without keeping a second copy of the data.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Fills `bytes` bytes for tokens [pos, pos + n) of (salt, seq, layer), K or V
/// (`which` 0 or 1); `token_bytes` bytes per token. Bit 14 of every little-endian 16-bit
/// word is clear, so the bytes read as finite values in every storage dtype (f16, bf16, and
/// f32, whose exponent's top bit is bit 14 of its upper word): Session::Append refuses NaN
/// and infinity.
inline void FillPattern(uint64_t salt, uint64_t seq, uint32_t layer, int which, int64_t pos, int64_t n,
                        size_t token_bytes, uint8_t* out) {
  for (int64_t t = 0; t < n; ++t) {
    uint64_t base = SplitMix64(salt ^ SplitMix64(seq * 1000003ull + layer * 7919ull + which) ^
                               static_cast<uint64_t>(pos + t) * 0xd6e8feb86659fd93ull);
    uint8_t* dst = out + static_cast<size_t>(t) * token_bytes;
    for (size_t i = 0; i < token_bytes; i += 8) {
      base = SplitMix64(base);
      for (size_t j = 0; j < 8 && i + j < token_bytes; ++j)
        dst[i + j] = static_cast<uint8_t>(base >> (8 * j)) & (j % 2 == 1 ? 0xbf : 0xff);
    }
  }
}

}  // namespace kvtier
