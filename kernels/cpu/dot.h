// Small vector primitives shared by the store and retrieval (CPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
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

/// Rows are stored in blocks of kI8Block, transposed: block b holds rows [b*B, b*B+B),
/// element d of lane j at codes[(b*D + d)*B + j]. One probe element then meets B rows in
/// one multiply-add, with no per-row horizontal sum (what makes a row-wise int8 dot
/// compute-bound at small D). B = 8, one AVX2 register of fp32 lanes.
inline constexpr int kI8Block = 8;

/// Scalar reference of DotI8Block (tests check the vector paths against it).
inline void DotI8BlockScalar(const int8_t* block, const float* p, int D, float* out) {
  float acc[kI8Block] = {};
  for (int d = 0; d < D; ++d)
    for (int j = 0; j < kI8Block; ++j) acc[j] += static_cast<float>(block[d * kI8Block + j]) * p[d];
  for (int j = 0; j < kI8Block; ++j) out[j] = acc[j];
}

/// The kI8Block dot products of one transposed int8 block with an fp32 probe of length D.
/// The scalar loop is the reference; the vector paths compute the same sums.
inline void DotI8Block(const int8_t* block, const float* p, int D, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int d = 0;
  for (; d + 2 <= D; d += 2) {
    const __m128i c0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + d * kI8Block));
    const __m128i c1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + (d + 1) * kI8Block));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), _mm256_set1_ps(p[d]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1)), _mm256_set1_ps(p[d + 1]), acc1);
  }
  if (d < D) {
    const __m128i c0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + d * kI8Block));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), _mm256_set1_ps(p[d]), acc0);
  }
  _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));
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
