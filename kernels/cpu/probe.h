// The numeric core of the probe builders (ActQKV Sec. 4.1, Eq. 7-9; InfLLM mean pooling):
// pure functions on raw arrays, the CPU twins of the CUDA probe kernels. retrieval/probe.cc
// keeps the state (running statistics per layer), the checks and the factory strings and
// calls these for the arithmetic, so the retriever and the device compute one meaning.
//
// Layouts: q is [m, q_heads, head_dim] fp32 (query j of head h at (j * q_heads + h) * D);
// running statistics mean and m2 are [q_heads, head_dim] fp64; a probe is
// [kv_heads, head_dim] fp32, kv head g pooling q heads [g * G, g * G + G), G = q_heads / kv_heads.
#pragma once

#include <cstdint>

namespace kvtier::kernels {

struct ProbeShape {
  int q_heads = 0;   ///< > 0, a multiple of kv_heads
  int kv_heads = 0;  ///< > 0
  int head_dim = 0;  ///< > 0
};

/// Eq. 8's variance from a running sum of squared deviations and the count mt (>= 2):
/// sigma^2 = m2 / (mt - 1). The one place the denominator lives.
inline double ActVariance(double m2, int64_t count) { return m2 / static_cast<double>(count - 1); }

/// InfLLM mean pooling: probe[g] = mean over the m queries and the q heads of group g.
/// Sums in query-major, head-minor order with weight 1 / (m * G) per term (fp32).
void MeanPoolProbe(const ProbeShape& s, const float* q, int m, float* probe);

/// The queries' check where they live: *count = how many of x[0, n) are NaN or infinite, *first
/// = the index of the first of them (INT32_MAX when none). n in [0, INT32_MAX).
void CountNonFinite(const float* x, int32_t n, int32_t* count, int32_t* first);

/// Eq. 8, running form: merges the window q (m >= 1 queries) into the statistics of every q
/// head that have seen n_old query vectors so far (mean, m2 zero when n_old == 0). Chan et al.:
/// with the window's mean mu_w and sum of squares M2_w (two-pass, fp64),
/// delta = mu_w - mean, N = n_old + m, mean += delta * m / N, M2 += M2_w + delta^2 * n_old * m / N.
void ActMergeWindow(const ProbeShape& s, const float* q, int m, int64_t n_old, double* mean, double* m2);

/// Eq. 7 and Eq. 9 over statistics that already include this window (count = query vectors
/// merged, the window's m included). Per q head: phi_j = (q_j - z-bar)^2 / sigma^2 elementwise,
/// dimensions with sigma^2 <= eps contributing 0; weight_j = ||phi_j||_1 / ||Phi||_1 (uniform
/// 1/m when ||Phi||_1 == 0); head probe = sum_j weight_j q_j. The kv-head probe is the mean of
/// its group's head probes, accumulated in fp64 head-major then query order, rounded to fp32
/// once. count < 2 (sigma^2 undefined): mean pooling.
void ActWeightedProbe(const ProbeShape& s, const float* q, int m, const double* mean, const double* m2,
                      int64_t count, double eps, float* probe);

}  // namespace kvtier::kernels
