// Chunk scoring and per-layer top-k: the CPU twins that define what the CUDA scoring and
// top-k kernels compute, and the arithmetic retrieval's Exact index runs on the CPU.
//
// A chunk is scored by its best representative per kv head, folded over the heads
// (retrieval/exact_index.h, the meaning of its two-stage search):
//   logit(c)  = fold_h max_r <p_h, k_{c,r,h}>                (InfLLM's q.k, best key per head)
//   cosine(c) = fold_h max_r cos(p_h, k_{c,r,h})             (ActQKV Eq. 10 per head)
// fold = sum (cosines averaged, so they stay in [-1, 1]) or max. Dots use Dot/DotKey's
// summation order (kernels/cpu/dot.h); cosines multiply by stored inverse norms.
//
// Top-k: per segment (one per layer), the indices of its k best scores, best first, ties
// broken by the lower index; -0.0 and +0.0 are equal scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels/cpu/attention.h"  // KernelError
#include "kernels/cpu/dot.h"
#include "kernels/dtype.h"

namespace kvtier::kernels {

/// How the kv heads' best scores make a chunk's totals; totals start at Start().
struct HeadFold {
  enum class Kind : uint8_t { kSum = 0, kMax = 1 };
  bool max = false;
  float cos_share = 1.0f;
  HeadFold(Kind kind, int n_heads)
      : max(kind == Kind::kMax), cos_share(max ? 1.0f : 1.0f / static_cast<float>(n_heads)) {}
  float Start() const { return max ? -std::numeric_limits<float>::infinity() : 0.0f; }
  void Add(float best, float best_cos, float* raw, float* cos) const {
    *raw = max ? std::max(*raw, best) : *raw + best;
    *cos = max ? std::max(*cos, best_cos) : *cos + best_cos * cos_share;
  }
};

/// 1 / |p| (Dot's order), 0 for a zero vector.
inline float InverseNorm(const float* p, int D) {
  const float pn2 = Dot(p, p, D);
  return pn2 > 0.0f ? 1.0f / std::sqrt(pn2) : 0.0f;
}

#if defined(__AVX512F__)
/// The largest of v's 16 lanes as the fold acc = std::max(acc, v[l]) from acc = v[0] over
/// l = 1..15 in order gives it: the first lane holding the largest value wins a tie (so a zero
/// keeps the sign of its first lane). No lane may be NaN, or every lane (NaN comes back). Pairs
/// of neighbouring ranges are combined, the earlier range kept on a tie
/// (_mm512_max_ps(later, earlier)), in 4 steps.
[[gnu::always_inline]] inline float MaxOfLanesInOrder(__m512 v) {
  v = _mm512_max_ps(_mm512_permute_ps(v, 0xB1), v);        // lanes 2i, 2i+1
  v = _mm512_max_ps(_mm512_permute_ps(v, 0x4E), v);        // 4i..4i+1, 4i+2..4i+3
  v = _mm512_max_ps(_mm512_shuffle_f32x4(v, v, 0xB1), v);  // 8i..8i+3, 8i+4..8i+7
  v = _mm512_max_ps(_mm512_shuffle_f32x4(v, v, 0x4E), v);  // 0..7, 8..15
  return _mm512_cvtss_f32(v);
}
#endif

/// The best of n dots and of their cosines dot[r] * inv_norm[r] * inv_p (each product in that
/// order, as ScoreChunksOneHead computes it), folded into *best (start -inf) and *best_cos
/// (start -1). NaN dots are skipped as std::max(best, dot) skips them; among equal values the
/// sign of a zero may differ from a sequential std::max (they compare equal). The result is a
/// function of the inputs alone, the same bits on every call (ScoreChunks, a gathered subset).
inline void MaxDotAndCosine(const float* dot, const float* inv_norm, float inv_p, size_t n, float* best,
                            float* best_cos) {
  float b = *best, bc = *best_cos;
  size_t r = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    // _mm512_max_ps(x, acc) returns acc where x is NaN or equal: std::max(acc, x) per lane.
    // Each lane starts at b (bc), so no lane is NaN unless b (bc) is, and then every lane is.
    __m512 vb = _mm512_set1_ps(b), vc = _mm512_set1_ps(bc);
    const __m512 vp = _mm512_set1_ps(inv_p);
    for (; r + 16 <= n; r += 16) {
      const __m512 d = _mm512_loadu_ps(dot + r);
      vb = _mm512_max_ps(d, vb);
      vc = _mm512_max_ps(_mm512_mul_ps(_mm512_mul_ps(d, _mm512_loadu_ps(inv_norm + r)), vp), vc);
    }
    // The lanes folded into b in lane order (a NaN b stays NaN either way).
    b = std::max(b, MaxOfLanesInOrder(vb));
    bc = std::max(bc, MaxOfLanesInOrder(vc));
  }
#endif
  for (; r < n; ++r) {
    b = std::max(b, dot[r]);
    bc = std::max(bc, dot[r] * inv_norm[r] * inv_p);
  }
  *best = b;
  *best_cos = bc;
}

/// MaxDotAndCosine's *best alone, the same bits: for a caller that ranks by logit.
inline void MaxDot(const float* dot, size_t n, float* best) {
  float b = *best;
  size_t r = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vb = _mm512_set1_ps(b);
    for (; r + 16 <= n; r += 16) vb = _mm512_max_ps(_mm512_loadu_ps(dot + r), vb);
    b = std::max(b, MaxOfLanesInOrder(vb));
  }
#endif
  for (; r < n; ++r) b = std::max(b, dot[r]);
  *best = b;
}

namespace chunk_score_internal {
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// BestOfKeys' vector path for one dtype: keys [0, R16) (R16 = R rounded down to 16) sixteen at
// a time, two Dot8Keys in one register whose lane l holds key r + l, folded as
// MaxDotAndCosine's lanes fold them; returns R16, the keys done.
template <DType T, bool kCos>
[[gnu::always_inline]] inline size_t BestOfKeys16(const uint8_t* keys, size_t key_bytes, const float* p,
                                                  int D, size_t R, const float* inv_norm, float inv_p,
                                                  float* best, float* best_cos) {
  const size_t r16 = R / 16 * 16;
  if (r16 == 0) return 0;
  __m512 vb = _mm512_set1_ps(*best), vc = _mm512_set1_ps(*best_cos);
  const __m512 vp = _mm512_set1_ps(inv_p);
  for (size_t r = 0; r < r16; r += 16) {
    const __m256 lo = dot_internal::Dot8Keys<T>(keys + r * key_bytes, key_bytes, p, D);
    const __m256 hi = dot_internal::Dot8Keys<T>(keys + (r + 8) * key_bytes, key_bytes, p, D);
    const __m512 d = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
    vb = _mm512_max_ps(d, vb);
    if constexpr (kCos)
      vc = _mm512_max_ps(_mm512_mul_ps(_mm512_mul_ps(d, _mm512_loadu_ps(inv_norm + r)), vp), vc);
  }
  *best = std::max(*best, MaxOfLanesInOrder(vb));
  if constexpr (kCos) *best_cos = std::max(*best_cos, MaxOfLanesInOrder(vc));
  return r16;
}
#endif
}  // namespace chunk_score_internal

/// One chunk's best key for one head, straight from its R keys stored in dtype t (key_bytes
/// apart): what DotKeys into `scratch` (R floats) and then MaxDotAndCosine (inv_norm not null)
/// or MaxDot (inv_norm null: *best_cos untouched) give, bit for bit, with the dots of sixteen
/// keys kept in registers (no store and reload between the two).
inline void BestOfKeys(DType t, const void* keys, size_t key_bytes, const float* p, int D, size_t R,
                       const float* inv_norm, float inv_p, float* best, float* best_cos, float* scratch) {
  const uint8_t* k = static_cast<const uint8_t*>(keys);
  size_t done = 0;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if (D % 8 == 0) {
    using chunk_score_internal::BestOfKeys16;
    const bool c = inv_norm != nullptr;
    switch (t) {
      case DType::kF32:
        done = c ? BestOfKeys16<DType::kF32, true>(k, key_bytes, p, D, R, inv_norm, inv_p, best, best_cos)
                 : BestOfKeys16<DType::kF32, false>(k, key_bytes, p, D, R, inv_norm, inv_p, best, best_cos);
        break;
      case DType::kF16:
        done = c ? BestOfKeys16<DType::kF16, true>(k, key_bytes, p, D, R, inv_norm, inv_p, best, best_cos)
                 : BestOfKeys16<DType::kF16, false>(k, key_bytes, p, D, R, inv_norm, inv_p, best, best_cos);
        break;
      case DType::kBF16:
        done = c ? BestOfKeys16<DType::kBF16, true>(k, key_bytes, p, D, R, inv_norm, inv_p, best, best_cos)
                 : BestOfKeys16<DType::kBF16, false>(k, key_bytes, p, D, R, inv_norm, inv_p, best, best_cos);
        break;
    }
  }
#endif
  if (done == R) return;
  // The rest (or all, without the vector path): MaxDotAndCosine's own tail past a multiple of 16.
  DotKeys(t, k + done * key_bytes, key_bytes, p, D, R - done, scratch);
  if (done > 0) {  // MaxDotAndCosine's scalar tail
    for (size_t r = 0; r < R - done; ++r) {
      *best = std::max(*best, scratch[r]);
      if (inv_norm != nullptr) *best_cos = std::max(*best_cos, scratch[r] * inv_norm[done + r] * inv_p);
    }
  } else if (inv_norm != nullptr) {
    MaxDotAndCosine(scratch, inv_norm, inv_p, R, best, best_cos);
  } else {
    MaxDot(scratch, R, best);
  }
}

/// One kv head's contribution to chunks [c0, c1): keys [n, R, D] in dtype dt (this head's),
/// inv_norm [n, R], probe p [D] with inverse norm inv_p; raw and cos indexed by chunk.
/// ip is scratch of (c1 - c0) * R floats.
inline void ScoreChunksOneHead(DType dt, const void* keys, const float* inv_norm, const float* p, float inv_p,
                               int D, int R, size_t c0, size_t c1, const HeadFold& fold, float* ip,
                               float* raw, float* cos) {
  const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(dt);
  const uint8_t* k = static_cast<const uint8_t*>(keys);
  DotKeys(dt, k + c0 * R * key_bytes, key_bytes, p, D, (c1 - c0) * R, ip);
  for (size_t c = c0; c < c1; ++c) {
    float best = -std::numeric_limits<float>::infinity(), best_cos = -1.0f;
    for (int r = 0; r < R; ++r) {
      const float dot = ip[(c - c0) * R + r];
      best = std::max(best, dot);
      best_cos = std::max(best_cos, dot * inv_norm[c * R + r] * inv_p);
    }
    fold.Add(best, best_cos, &raw[c], &cos[c]);
  }
}

struct ChunkScoreParams {
  int kv_heads = 0;                            ///< > 0
  int head_dim = 0;                            ///< > 0
  int repr = 0;                                ///< representatives per chunk, > 0
  DType dtype = DType::kF16;                   ///< storage dtype of keys
  HeadFold::Kind fold = HeadFold::Kind::kSum;  ///< how heads combine
  int64_t n_chunks = 0;                        ///< >= 0
  /// Chunks between one head's keys and the next's: 0 = n_chunks (packed). A buffer that
  /// grows by doubling (retrieval's device mirror) holds `capacity` rows per head and scores
  /// the first n_chunks of them; then keys are [kv_heads, chunk_stride, repr, head_dim] and
  /// inv_norm [kv_heads, chunk_stride, repr]. Must be 0 or >= n_chunks.
  int64_t chunk_stride = 0;
  const void* keys = nullptr;       ///< [kv_heads, n_chunks, repr, head_dim] dtype (one head contiguous)
  const float* inv_norm = nullptr;  ///< [kv_heads, n_chunks, repr] 1/|key| (0 for a zero key)
  const float* probe = nullptr;     ///< [kv_heads, head_dim] fp32
  float* logit = nullptr;           ///< [n_chunks] out
  float* cosine = nullptr;          ///< [n_chunks] out
};

/// Validates shapes and pointers (kOk, kBadShape, kNullPointer, kBadDType); shared by the
/// CPU twin and the CUDA launcher, which cannot look at device memory.
KernelError CheckChunkScoreParams(const ChunkScoreParams& p);
/// The head stride in chunks: chunk_stride, or n_chunks when it is 0.
inline int64_t ChunkStride(const ChunkScoreParams& p) {
  return p.chunk_stride > 0 ? p.chunk_stride : p.n_chunks;
}
/// CPU twin: every chunk, every head.
KernelError ScoreChunks(const ChunkScoreParams& p);

struct SegmentedTopKParams {
  int n_segments = 0;                ///< >= 0 (one per layer)
  const int32_t* offsets = nullptr;  ///< [n_segments + 1] non-decreasing, offsets[0] == 0
  const float* scores = nullptr;     ///< [offsets[n_segments]] fp32, no NaN
  const int32_t* k = nullptr;        ///< [n_segments] how many each segment takes (>= 0; clamped to its size)
  int k_max = 0;                     ///< >= every k[i]; the row stride of the outputs
  int32_t* out_index =
      nullptr;  ///< [n_segments, k_max] index within the segment, best first; -1 after the take
  float* out_score = nullptr;  ///< optional [n_segments, k_max] the scores; -inf after the take
};

/// Host-side checks of the shape fields (kBadShape for k_max < 0, kNullPointer); the CPU twin
/// also checks the arrays' contents.
KernelError CheckSegmentedTopKParams(const SegmentedTopKParams& p);
/// CPU twin (std::partial_sort on (score desc, index asc)).
KernelError SegmentedTopK(const SegmentedTopKParams& p);

}  // namespace kvtier::kernels
