// Small vector primitives shared by the store and retrieval (CPU).
#pragma once

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

}  // namespace kvtier::kernels
