// Small vector primitives shared by the store and retrieval (CPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

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

/// Dot product of int8 codes with an fp32 vector (the caller multiplies by the codes'
/// scale). Sixteen partial sums, so the int8 -> fp32 widening vectorises.
inline float DotI8(const int8_t* a, const float* b, int n) {
  float acc[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += static_cast<float>(a[i + j]) * b[i + j];
  float s = 0.0f;
  for (; i < n; ++i) s += static_cast<float>(a[i]) * b[i];
  for (float x : acc) s += x;
  return s;
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
