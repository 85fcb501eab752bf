// Small vector primitives shared by the store and retrieval (CPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvtier::kernels {

/// fp32 dot product with eight independent partial sums, so the compiler
/// vectorises the reduction without -ffast-math reassociating it.
inline float Dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (float x : acc) s += x;
  return s;
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

/// The probe side of DotI8Block: p ~= scale * out, out int16 of length D rounded up to even
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

/// Scalar reference of DotI8Block (tests check the vector path against it: both are exact
/// integer sums, so they agree bit for bit).
inline void DotI8BlockScalar(const int8_t* block, const int16_t* p, int D, int32_t* out) {
  for (int j = 0; j < kI8Block; ++j) {
    int32_t acc = 0;
    for (int d = 0; d < D; ++d) acc += static_cast<int32_t>(block[I8Offset(d, j)]) * p[d];
    out[j] = acc;
  }
}

/// The kI8Block dot products of one paired int8 block with an int16 probe (QuantizeProbeI16)
/// of length D; the real dot of row j is out[j] * row_scale[j] * probe_scale.
inline void DotI8Block(const int8_t* block, const int16_t* p, int D, int32_t* out) {
#if defined(__AVX2__)
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  const int pairs = (D + 1) / 2;
  // p has D rounded up to even elements (the pad is 0): read pair k as one 32-bit word.
  auto pair = [&](int k) {
    return _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint16_t>(p[2 * k])) |
                             (static_cast<int32_t>(static_cast<uint16_t>(p[2 * k + 1])) << 16));
  };
  int k = 0;
  for (; k + 2 <= pairs; k += 2) {
    const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + static_cast<size_t>(k) * 16));
    const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + static_cast<size_t>(k + 1) * 16));
    acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(c0), pair(k)));
    acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_cvtepi8_epi16(c1), pair(k + 1)));
  }
  if (k < pairs) {
    const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + static_cast<size_t>(k) * 16));
    acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(c0), pair(k)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_add_epi32(acc0, acc1));
#else
  DotI8BlockScalar(block, p, D, out);
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
  for (int i = 0; i < n; ++i) codes[i] = static_cast<int8_t>(std::lrint(std::clamp(x[i] * inv, -127.0f, 127.0f)));
  return m / 127.0f;
}

}  // namespace kvtier::kernels
