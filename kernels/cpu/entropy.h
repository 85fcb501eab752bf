// Eq. 11 of ActQKV (the entropy of a layer's chunk-similarity distribution), the CPU twin
// that defines what the CUDA entropy kernel computes. Retrieval's entropy budget
// (retrieval/budget.h, Eq. 12) calls SoftmaxEntropy; the segmented form serves every
// layer of a step in one call, as the device does.
#pragma once

#include <cstdint>

#include "kernels/cpu/attention.h"  // KernelError

namespace kvtier::kernels {

/// Eq. 11: entropy of softmax(s) in nats, computed stably (subtract the max), in fp64:
/// Theta = log Z - sum_i e_i (s_i - max) / Z, e_i = exp(s_i - max), Z = sum_i e_i. 0 when
/// n <= 0 or s is null; never negative. Scores must be finite (callers check).
double SoftmaxEntropy(const float* s, int n);

/// Segments of one score array: segment i is scores[offsets[i] .. offsets[i+1]).
struct EntropyParams {
  int n_segments = 0;                ///< >= 0 (one per layer)
  const int32_t* offsets = nullptr;  ///< [n_segments + 1] non-decreasing, offsets[0] >= 0
  const float* scores = nullptr;     ///< [offsets[n_segments]] fp32, finite
  double* entropy = nullptr;         ///< [n_segments] out: Eq. 11 of each segment (0 when empty)
  /// Optional [n_segments] out: how many scores of each segment are not finite. Eq. 11 is
  /// defined for finite scores only, and a NaN does not show in the entropy (the clamp to
  /// >= 0 turns it into 0), so a caller that cannot read the scores (they are on a device)
  /// learns here that they were unfit. Null: not counted.
  int32_t* non_finite = nullptr;
};

/// CPU twin: entropy[i] = SoftmaxEntropy(segment i) (and non_finite[i] when asked). kBadShape for decreasing
/// offsets, kNullPointer for a missing array (scores may be null when every segment is empty).
KernelError SegmentEntropy(const EntropyParams& p);

}  // namespace kvtier::kernels
