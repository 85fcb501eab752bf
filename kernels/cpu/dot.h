// Small vector primitives shared by the store and retrieval (CPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels/dtype.h"

namespace kvtier::kernels {

/// fp32 dot product with eight independent partial sums (one FMA lane each), then the tail,
/// then the lanes in order. Written out so that DotKey can repeat it exactly.
inline float Dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v);
  _mm256_storeu_ps(acc, v);
#else
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] = std::fma(a[i + j], b[i + j], acc[j]);
#endif
  float s = 0.0f;
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);  // an explicit FMA: the same rounding wherever inlined
  for (float x : acc) s += x;
  return s;
}

/// Dot of an fp32 probe with a key stored in dtype t: the key is converted exactly to fp32
/// and summed in Dot's order, so the result equals Dot over the converted key bit for bit
/// (a test checks this).
/// A 16-bit key is half the bytes of its fp32 copy, which is what a memory-bound rescoring
/// pass pays for.
inline float DotKey(DType t, const void* key, const float* p, int n) {
  if (t == DType::kF32) return Dot(static_cast<const float*>(key), p, n);
  const uint16_t* k = static_cast<const uint16_t*>(key);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  // Dot's eight partial sums are eight lanes of one register (Dot compiles to these FMAs).
  __m256 a = _mm256_setzero_ps();
  if (t == DType::kF16) {
    for (; i + 8 <= n; i += 8)
      a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i))),
                          _mm256_loadu_ps(p + i), a);
  } else {
    for (; i + 8 <= n; i += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i)));
      a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)), _mm256_loadu_ps(p + i), a);
    }
  }
  _mm256_storeu_ps(acc, a);
#else
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j)
      acc[j] = std::fma(t == DType::kF16 ? F16ToFloat(k[i + j]) : Bf16ToFloat(k[i + j]), p[i + j], acc[j]);
#endif
  float s = 0.0f;
  for (; i < n; ++i) {
    const float x = t == DType::kF16 ? F16ToFloat(k[i]) : Bf16ToFloat(k[i]);
    s = std::fma(x, p[i], s);
  }
  for (float v : acc) s += v;
  return s;
}

namespace dot_internal {

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// Eight lanes of key elements [d, d + 8) of a key stored in dtype T, converted exactly to fp32.
template <DType T>
[[gnu::always_inline]] inline __m256 LoadKey8(const uint8_t* key, int d) {
  if constexpr (T == DType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(key) + d);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(key) + d));
    if constexpr (T == DType::kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// DotKey of the eight keys base, base + stride, ..., base + 7 stride in lanes 0..7, bit for
// bit (n a multiple of 8): their eight partial sums in eight registers, the lanes added in
// DotKey's order after an 8x8 transpose. Always inlined: its result stays in a register.
template <DType T>
[[gnu::always_inline]] inline __m256 Dot8Keys(const uint8_t* base, size_t stride, const float* p, int n) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int d = 0; d < n; d += 8) {
    const __m256 pv = _mm256_loadu_ps(p + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(LoadKey8<T>(base + j * stride, d), pv, a[j]);
  }
  // Transpose: lane l of key j goes to register l, position j.
  const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
  const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
  const __m256 t4 = _mm256_unpacklo_ps(a[4], a[5]), t5 = _mm256_unpackhi_ps(a[4], a[5]);
  const __m256 t6 = _mm256_unpacklo_ps(a[6], a[7]), t7 = _mm256_unpackhi_ps(a[6], a[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  const __m256 lane[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                          _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                          _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                          _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
  // DotKey's tail-free sum: s = 0, then s += acc[0], ..., s += acc[7].
  __m256 sum = _mm256_add_ps(_mm256_setzero_ps(), lane[0]);
  for (int l = 1; l < 8; ++l) sum = _mm256_add_ps(sum, lane[l]);
  return sum;
}

// DotKeys' eight-at-a-time path for one dtype (the dtype chosen once per call, not per load);
// returns how many keys it did (a multiple of 8).
template <DType T>
inline size_t DotKeys8(const uint8_t* base, size_t stride, const float* p, int n, size_t count, float* out) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, Dot8Keys<T>(base + i * stride, stride, p, n));
  return i;
}
#endif

}  // namespace dot_internal

/// DotKey of `count` keys spaced `stride` bytes apart with one probe: out[i] = DotKey(t, key_i,
/// p, n), bit for bit. Eight keys at a time keep their eight partial sums in eight registers
/// and add the lanes in DotKey's order after an 8x8 transpose, so the horizontal sums, one
/// dependent chain per key in DotKey, run side by side (the rescoring of short keys, e.g.
/// head_dim 16, is dominated by them). n not a multiple of 8 takes DotKey key by key.
inline void DotKeys(DType t, const void* keys, size_t stride, const float* p, int n, size_t count,
                    float* out) {
  const uint8_t* base = static_cast<const uint8_t*>(keys);
  size_t i = 0;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if (n % 8 == 0) {
    switch (t) {
      case DType::kF32:
        i = dot_internal::DotKeys8<DType::kF32>(base, stride, p, n, count, out);
        break;
      case DType::kF16:
        i = dot_internal::DotKeys8<DType::kF16>(base, stride, p, n, count, out);
        break;
      case DType::kBF16:
        i = dot_internal::DotKeys8<DType::kBF16>(base, stride, p, n, count, out);
        break;
    }
  }
#endif
  for (; i < count; ++i) out[i] = DotKey(t, base + i * stride, p, n);
}

/// Rows are stored in blocks of kI8Block, transposed in pairs of elements: block b holds
/// rows [b*B, b*B+B) in I8BlockBytes(D) bytes, element d of lane j at
/// block[I8Offset(d, j)] = (d/2)*2B + 2j + d%2 (an odd D gets a zero pad). One pair of
/// probe elements then meets B rows in one int16 multiply-add (vpmaddwd), with no per-row
/// horizontal sum: 16 multiply-adds per instruction, against 8 for int8 -> fp32
/// conversion and an fp32 FMA. B = 8, one AVX2 register of int32 lanes.
inline constexpr int kI8Block = 8;
inline constexpr size_t I8BlockBytes(int D) { return static_cast<size_t>((D + 1) / 2) * 2 * kI8Block; }
inline constexpr size_t I8Offset(int d, int lane) {
  return static_cast<size_t>(d / 2) * 2 * kI8Block + 2 * static_cast<size_t>(lane) + (d & 1);
}

/// The probe side of DotI8Blocks: p ~= scale * out, out int16 of length D rounded up to even
/// (the pad is 0). Its largest magnitude is min(32767, (2^31 - 1) / (127 * D_even)), so no
/// int32 sum of D products with int8 codes can overflow. Returns the scale (0 for a zero or
/// non-finite probe, whose codes are all 0).
inline float QuantizeProbeI16(const float* p, int D, int16_t* out) {
  const int de = (D + 1) / 2 * 2;
  float m = 0.0f;
  for (int i = 0; i < D; ++i) m = std::max(m, std::fabs(p[i]));
  for (int i = 0; i < de; ++i) out[i] = 0;
  if (m == 0.0f || !std::isfinite(m)) return 0.0f;
  const float q = static_cast<float>(std::min<int64_t>(32767, 2147483647LL / (127LL * de)));
  const float inv = q / m;
  for (int i = 0; i < D; ++i) out[i] = static_cast<int16_t>(std::lrint(std::clamp(p[i] * inv, -q, q)));
  return m / q;
}

/// Scalar reference of DotI8Blocks (tests check the vector paths against it: all are exact
/// integer sums, so they agree bit for bit).
inline void DotI8BlocksScalar(const int8_t* blocks, size_t n_blocks, const int16_t* p, int D, int32_t* out) {
  const size_t block_bytes = I8BlockBytes(D);
  for (size_t b = 0; b < n_blocks; ++b)
    for (int j = 0; j < kI8Block; ++j) {
      int32_t acc = 0;
      for (int d = 0; d < D; ++d)
        acc += static_cast<int32_t>(blocks[b * block_bytes + I8Offset(d, j)]) * p[d];
      out[b * kI8Block + j] = acc;
    }
}

/// The dot products of n_blocks consecutive paired int8 blocks (n_blocks * kI8Block rows)
/// with an int16 probe (QuantizeProbeI16) of length D: out[j] for row j; the real dot of
/// row j is out[j] * row_scale[j] * probe_scale.
inline void DotI8Blocks(const int8_t* blocks, size_t n_blocks, const int16_t* p, int D, int32_t* out) {
  [[maybe_unused]] const int pairs = (D + 1) / 2;
  [[maybe_unused]] const size_t block_bytes = I8BlockBytes(D);
  // p has D rounded up to even elements (the pad is 0): pair k is one 32-bit word.
  [[maybe_unused]] auto word = [&](int k) {
    return static_cast<int32_t>(static_cast<uint16_t>(p[2 * k])) |
           (static_cast<int32_t>(static_cast<uint16_t>(p[2 * k + 1])) << 16);
  };
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // One 32-byte load holds pairs k and k+1 of the block's 8 rows; widened to 32 int16 it
  // meets a probe register whose low 8 lanes are pair k and high 8 lanes pair k+1, and
  // vpdpwssd multiplies and accumulates 32 int16 products in one instruction (twice the
  // AVX2 path's work per instruction, with no separate add). The probe registers are
  // built once per call; heads up to 512 wide fit the stack table.
  constexpr int kMaxQuads = 128;
  const int quads = pairs / 2;
  if (quads <= kMaxQuads) {
    __m512i pk[kMaxQuads];
    for (int q = 0; q < quads; ++q)
      pk[q] = _mm512_inserti64x4(_mm512_set1_epi32(word(2 * q)), _mm256_set1_epi32(word(2 * q + 1)), 1);
    const bool odd_pair = pairs % 2 != 0;
    const __m256i last = odd_pair ? _mm256_set1_epi32(word(pairs - 1)) : _mm256_setzero_si256();
    for (size_t b = 0; b < n_blocks; ++b) {
      const int8_t* block = blocks + b * block_bytes;
      __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
      int q = 0;
      for (; q + 2 <= quads; q += 2) {
        const __m256i c0 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + static_cast<size_t>(q) * 32));
        const __m256i c1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + static_cast<size_t>(q + 1) * 32));
        acc0 = _mm512_dpwssd_epi32(acc0, _mm512_cvtepi8_epi16(c0), pk[q]);
        acc1 = _mm512_dpwssd_epi32(acc1, _mm512_cvtepi8_epi16(c1), pk[q + 1]);
      }
      if (q < quads) {
        const __m256i c0 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + static_cast<size_t>(q) * 32));
        acc0 = _mm512_dpwssd_epi32(acc0, _mm512_cvtepi8_epi16(c0), pk[q]);
      }
      acc0 = _mm512_add_epi32(acc0, acc1);
      __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(acc0), _mm512_extracti64x4_epi64(acc0, 1));
      if (odd_pair) {
        const __m128i c =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + static_cast<size_t>(pairs - 1) * 16));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_cvtepi8_epi16(c), last));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kI8Block), sum);
    }
    return;
  }
#endif
#if defined(__AVX2__)
  // The probe's pair words are broadcast once per call (D up to 2 * kMaxPairs; wider heads
  // build them per block), and two blocks go through the pairs together: four independent
  // accumulators keep the loads in flight, which is what bounds this loop (the codes stream
  // from memory).
  constexpr int kMaxPairs = 128;
  __m256i pk_table[kMaxPairs];
  const bool table = pairs <= kMaxPairs;
  if (table)
    for (int k = 0; k < pairs; ++k) pk_table[k] = _mm256_set1_epi32(word(k));
  auto pk = [&](int k) { return table ? pk_table[k] : _mm256_set1_epi32(word(k)); };
  auto madd = [](const int8_t* codes, __m256i probe) {
    return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))),
                             probe);
  };
  size_t b = 0;
  for (; b + 2 <= n_blocks; b += 2) {
    const int8_t* x = blocks + b * block_bytes;
    const int8_t* y = x + block_bytes;
    __m256i x0 = _mm256_setzero_si256(), x1 = x0, y0 = x0, y1 = x0;
    int k = 0;
    for (; k + 2 <= pairs; k += 2) {
      const __m256i p0 = pk(k), p1 = pk(k + 1);
      const size_t o = static_cast<size_t>(k) * 16;
      x0 = _mm256_add_epi32(x0, madd(x + o, p0));
      x1 = _mm256_add_epi32(x1, madd(x + o + 16, p1));
      y0 = _mm256_add_epi32(y0, madd(y + o, p0));
      y1 = _mm256_add_epi32(y1, madd(y + o + 16, p1));
    }
    if (k < pairs) {
      const size_t o = static_cast<size_t>(k) * 16;
      x0 = _mm256_add_epi32(x0, madd(x + o, pk(k)));
      y0 = _mm256_add_epi32(y0, madd(y + o, pk(k)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kI8Block), _mm256_add_epi32(x0, x1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (b + 1) * kI8Block), _mm256_add_epi32(y0, y1));
  }
  for (; b < n_blocks; ++b) {
    const int8_t* x = blocks + b * block_bytes;
    __m256i x0 = _mm256_setzero_si256(), x1 = x0;
    int k = 0;
    for (; k + 2 <= pairs; k += 2) {
      const size_t o = static_cast<size_t>(k) * 16;
      x0 = _mm256_add_epi32(x0, madd(x + o, pk(k)));
      x1 = _mm256_add_epi32(x1, madd(x + o + 16, pk(k + 1)));
    }
    if (k < pairs) x0 = _mm256_add_epi32(x0, madd(x + static_cast<size_t>(k) * 16, pk(k)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kI8Block), _mm256_add_epi32(x0, x1));
  }
#else
  (void)word;
  DotI8BlocksScalar(blocks, n_blocks, p, D, out);
#endif
}

/// 4-bit codes, blocked as the int8 ones: block b holds rows [b*B, b*B+B) (B = kI4Block = 8),
/// element d of lane j in byte I4Byte(d, j) = (d/4)*16 + 2j + d%2, in its low nibble when
/// (d/2) is even and its high nibble when odd: one 16-byte load holds element pairs 2k (low
/// nibbles) and 2k+1 (high nibbles) of the block's 8 rows, each in DotI8Blocks' pair order, so
/// two shifts make them the two int16 vectors vpmaddwd meets with pairs 2k and 2k+1 of the
/// probe. Half the bytes of the int8 blocks (D rounded up to a multiple of 4; the pad is 0).
/// Codes are two's complement nibbles in [-7, 7].
inline constexpr int kI4Block = 8;
inline constexpr size_t I4BlockBytes(int D) { return static_cast<size_t>((D + 3) / 4) * 2 * kI4Block; }
inline constexpr size_t I4Byte(int d, int lane) {
  return static_cast<size_t>(d / 4) * 2 * kI4Block + 2 * static_cast<size_t>(lane) + (d & 1);
}
/// The shift of element d's nibble in its byte (0: low, 4: high).
inline constexpr int I4Shift(int d) { return (d / 2) % 2 == 0 ? 0 : 4; }
/// The probe length DotI4Blocks reads: D rounded up to a multiple of 4.
inline constexpr int I4ProbeLength(int D) { return (D + 3) / 4 * 4; }

/// Writes code c (in [-8, 7]) of element d, lane `lane`, into a block (its other nibble kept).
inline void PutI4(uint8_t* block, int d, int lane, int8_t c) {
  uint8_t& b = block[I4Byte(d, lane)];
  const int sh = I4Shift(d);
  b = static_cast<uint8_t>((b & ~(0x0F << sh)) | ((static_cast<uint8_t>(c) & 0x0F) << sh));
}
/// Reads code of element d, lane `lane`, sign-extended.
inline int8_t GetI4(const uint8_t* block, int d, int lane) {
  const int v = (block[I4Byte(d, lane)] >> I4Shift(d)) & 0x0F;
  return static_cast<int8_t>(v >= 8 ? v - 16 : v);
}

/// Symmetric 4-bit quantisation of one vector: codes = round(x / scale) in [-7, 7], scale =
/// max|x| / 7 (0 for a zero or non-finite vector, codes 0). Returns the scale.
inline float QuantizeI4(const float* x, int n, int8_t* codes) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  if (m == 0.0f || !std::isfinite(m)) {
    for (int i = 0; i < n; ++i) codes[i] = 0;
    return 0.0f;
  }
  const float inv = 7.0f / m;
  for (int i = 0; i < n; ++i) codes[i] = static_cast<int8_t>(std::lrint(std::clamp(x[i] * inv, -7.0f, 7.0f)));
  return m / 7.0f;
}

/// Scalar reference of DotI4Blocks (exact integer sums: the vector paths agree bit for bit).
inline void DotI4BlocksScalar(const uint8_t* blocks, size_t n_blocks, const int16_t* p, int D, int32_t* out) {
  const size_t block_bytes = I4BlockBytes(D);
  for (size_t b = 0; b < n_blocks; ++b)
    for (int j = 0; j < kI4Block; ++j) {
      int32_t acc = 0;
      for (int d = 0; d < D; ++d) acc += static_cast<int32_t>(GetI4(blocks + b * block_bytes, d, j)) * p[d];
      out[b * kI4Block + j] = acc;
    }
}

namespace dot_internal {

// The pair word k of an int16 probe: elements 2k (low half) and 2k + 1 (high half).
inline int32_t ProbeWord(const int16_t* p, int k) {
  return static_cast<int32_t>(static_cast<uint16_t>(p[2 * k])) |
         (static_cast<int32_t>(static_cast<uint16_t>(p[2 * k + 1])) << 16);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// DotI4Blocks' AVX-512 VNNI path, for D <= 512 (the probe table on the stack). Each 16-byte
// group becomes one 32-lane int16 vector (low nibbles, pair 2k, in lanes 0..15; high nibbles,
// pair 2k+1, in 16..31) that vpdpwssd meets with [pair 2k | pair 2k+1] of the probe.
inline void DotI4BlocksAvx512(const uint8_t* blocks, size_t n_blocks, const int16_t* p, int D, int32_t* out) {
  const int quads = (D + 3) / 4;
  const size_t block_bytes = I4BlockBytes(D);
  __m512i pk[128];
  for (int q = 0; q < quads; ++q)
    pk[q] = _mm512_inserti64x4(_mm512_set1_epi32(ProbeWord(p, 2 * q)),
                               _mm256_set1_epi32(ProbeWord(p, 2 * q + 1)), 1);
  // Nibbles to int16: the byte in a word's high half, or its low nibble on top (shifted left by
  // 12), then an arithmetic shift right by 12 sign-extends the nibble.
  auto widen = [](const uint8_t* g) {
    const __m512i w = _mm512_cvtepu8_epi16(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g))));
    return _mm512_srai_epi16(
        _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_slli_epi16(w, 12), _mm512_slli_epi16(w, 8)), 12);
  };
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint8_t* block = blocks + b * block_bytes;
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    int q = 0;
    for (; q + 2 <= quads; q += 2) {
      acc0 = _mm512_dpwssd_epi32(acc0, widen(block + static_cast<size_t>(q) * 16), pk[q]);
      acc1 = _mm512_dpwssd_epi32(acc1, widen(block + static_cast<size_t>(q + 1) * 16), pk[q + 1]);
    }
    if (q < quads) acc0 = _mm512_dpwssd_epi32(acc0, widen(block + static_cast<size_t>(q) * 16), pk[q]);
    acc0 = _mm512_add_epi32(acc0, acc1);
    const __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(acc0), _mm512_extracti64x4_epi64(acc0, 1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kI4Block), sum);
  }
}
#endif

#if defined(__AVX2__)
// DotI4Blocks' AVX2 path, any D: the probe's pair words broadcast once per call (D up to 512;
// wider heads build them per group), two blocks at a time for independent accumulators.
inline void DotI4BlocksAvx2(const uint8_t* blocks, size_t n_blocks, const int16_t* p, int D, int32_t* out) {
  const int quads = (D + 3) / 4, pairs = 2 * quads;
  const size_t block_bytes = I4BlockBytes(D);
  constexpr int kMaxPairs = 256;
  __m256i pk_table[kMaxPairs];
  const bool table = pairs <= kMaxPairs;
  if (table)
    for (int k = 0; k < pairs; ++k) pk_table[k] = _mm256_set1_epi32(ProbeWord(p, k));
  auto pk = [&](int k) { return table ? pk_table[k] : _mm256_set1_epi32(ProbeWord(p, k)); };
  // The 16 bytes of group q as two int16 vectors, low nibbles (pair 2q) and high (pair 2q+1),
  // each met with its probe pair by vpmaddwd.
  auto madd2 = [&](const uint8_t* g, int q) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    const __m256i lo = _mm256_srai_epi16(_mm256_slli_epi16(w, 12), 12);
    const __m256i hi = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 12);
    return _mm256_add_epi32(_mm256_madd_epi16(lo, pk(2 * q)), _mm256_madd_epi16(hi, pk(2 * q + 1)));
  };
  size_t b = 0;
  for (; b + 2 <= n_blocks; b += 2) {
    const uint8_t* x = blocks + b * block_bytes;
    const uint8_t* y = x + block_bytes;
    __m256i x0 = _mm256_setzero_si256(), y0 = x0;
    for (int q = 0; q < quads; ++q) {
      const size_t o = static_cast<size_t>(q) * 16;
      x0 = _mm256_add_epi32(x0, madd2(x + o, q));
      y0 = _mm256_add_epi32(y0, madd2(y + o, q));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kI4Block), x0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (b + 1) * kI4Block), y0);
  }
  for (; b < n_blocks; ++b) {
    const uint8_t* x = blocks + b * block_bytes;
    __m256i x0 = _mm256_setzero_si256();
    for (int q = 0; q < quads; ++q) x0 = _mm256_add_epi32(x0, madd2(x + static_cast<size_t>(q) * 16, q));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kI4Block), x0);
  }
}
#endif

}  // namespace dot_internal

/// The dot products of n_blocks consecutive int4 blocks (n_blocks * kI4Block rows) with an
/// int16 probe (QuantizeProbeI16's codes, zero-padded to I4ProbeLength(D) elements): out[j]
/// for row j; the real dot of row j is out[j] * row_scale[j] * probe_scale. Exact integer
/// sums, so every path equals DotI4BlocksScalar bit for bit; they cannot overflow: |code| <= 8
/// < 127, the bound QuantizeProbeI16's range is sized for. AVX-512 VNNI for D <= 512, else
/// AVX2, else the scalar twin.
inline void DotI4Blocks(const uint8_t* blocks, size_t n_blocks, const int16_t* p, int D, int32_t* out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (D <= 512) return dot_internal::DotI4BlocksAvx512(blocks, n_blocks, p, D, out);
#endif
#if defined(__AVX2__)
  dot_internal::DotI4BlocksAvx2(blocks, n_blocks, p, D, out);
#else
  DotI4BlocksScalar(blocks, n_blocks, p, D, out);
#endif
}

/// A group's best representative per row, from DotI8Blocks' output for the group's R blocks
/// (dots[r * kI8Block + lane]: representative r of row `lane`) and each key's code scale and
/// cosine scale at the same places: per lane l, over r = 0..R-1 in order,
///   best[l]          = max_r dots[r, l] * scale[r, l]
///   best_cos[l]      = max_r dots[r, l] * cos_scale[r, l]
///   max_scale[l]     = max_r scale[r, l]
///   max_cos_scale[l] = max_r cos_scale[r, l]
/// each max folded as acc = std::max(acc, x) from acc = the r = 0 value, bit for bit (a NaN x
/// is skipped, a NaN acc stays, equal values keep acc). R >= 1.
inline void MaxScaledI8Dots(const int32_t* dots, const float* scale, const float* cos_scale, int R,
                            float* best, float* best_cos, float* max_scale, float* max_cos_scale) {
  static_assert(kI8Block == 8, "one AVX2 register of lanes");
#if defined(__AVX2__)
  // _mm256_max_ps(x, acc) is (x > acc) ? x : acc per lane, which is std::max(acc, x): the same
  // value where x or acc is NaN and where they are equal. The int32 -> float conversion and the
  // products round as the scalar casts and products do.
  auto at = [](const float* v, int r) { return _mm256_loadu_ps(v + static_cast<size_t>(r) * kI8Block); };
  auto dot_at = [&](int r) {
    return _mm256_cvtepi32_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dots + static_cast<size_t>(r) * kI8Block)));
  };
  __m256 d = dot_at(0), s = at(scale, 0), c = at(cos_scale, 0);
  __m256 b = _mm256_mul_ps(d, s), bc = _mm256_mul_ps(d, c), ms = s, mc = c;
  for (int r = 1; r < R; ++r) {
    d = dot_at(r);
    s = at(scale, r);
    c = at(cos_scale, r);
    b = _mm256_max_ps(_mm256_mul_ps(d, s), b);
    bc = _mm256_max_ps(_mm256_mul_ps(d, c), bc);
    ms = _mm256_max_ps(s, ms);
    mc = _mm256_max_ps(c, mc);
  }
  _mm256_storeu_ps(best, b);
  _mm256_storeu_ps(best_cos, bc);
  _mm256_storeu_ps(max_scale, ms);
  _mm256_storeu_ps(max_cos_scale, mc);
#else
  constexpr int B = kI8Block;
  for (int lane = 0; lane < B; ++lane) {
    best[lane] = static_cast<float>(dots[lane]) * scale[lane];
    best_cos[lane] = static_cast<float>(dots[lane]) * cos_scale[lane];
    max_scale[lane] = scale[lane];
    max_cos_scale[lane] = cos_scale[lane];
  }
  for (int r = 1; r < R; ++r)
    for (int lane = 0; lane < B; ++lane) {
      const size_t j = static_cast<size_t>(r) * B + lane;
      best[lane] = std::max(best[lane], static_cast<float>(dots[j]) * scale[j]);
      best_cos[lane] = std::max(best_cos[lane], static_cast<float>(dots[j]) * cos_scale[j]);
      max_scale[lane] = std::max(max_scale[lane], scale[j]);
      max_cos_scale[lane] = std::max(max_cos_scale[lane], cos_scale[j]);
    }
#endif
}

/// Symmetric int8 quantisation of one vector: codes = round(x / scale), scale =
/// max|x| / 127 (0 for a zero vector). Returns the scale.
inline float QuantizeI8(const float* x, int n, int8_t* codes) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  if (m == 0.0f || !std::isfinite(m)) {
    for (int i = 0; i < n; ++i) codes[i] = 0;
    return 0.0f;
  }
  const float inv = 127.0f / m;
  for (int i = 0; i < n; ++i)
    codes[i] = static_cast<int8_t>(std::lrint(std::clamp(x[i] * inv, -127.0f, 127.0f)));
  return m / 127.0f;
}

}  // namespace kvtier::kernels
