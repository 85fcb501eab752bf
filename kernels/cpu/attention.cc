// CPU reference attention kernel. See attention.h for the contract.
//
// Work decomposition
//   * rows: a (query, q head) pair. A work item owns a block of HB kv heads, a
//     block of up to QB queries -- HB * QB * G rows (G = q_heads / kv_heads),
//     at most ~128 -- and one contiguous range of the concatenated key index
//     space (all parts, in the order given; softmax does not care).
//   * parallelism (oneTBB parallel_for over items): over kv-head blocks and
//     query blocks; when that gives fewer than 4 items per thread (decode),
//     also over key ranges (split-K). For decode, HB = all kv heads, so each
//     thread streams whole contiguous token rows of its key range.
//   * keys go in tiles of T tokens (T * padded head_dim ~ 2048 floats, so the
//     converted K and V tiles and their sources stay in L1). A
//     tile never crosses a span, so inside it positions are consecutive and a
//     query's causal mask is a prefix of the tile (its "visible count").
//   * each key row of a tile is converted to fp32 once (read in place for
//     fp32 storage) and reused by every row of the item (all q heads of the
//     GQA group, all queries of the block).
//   * per row group (RowGroup, 4 rows per AVX-512 vector): scores of 4 keys x
//     4 rows per transposed reduction -> online softmax (running max m,
//     running sum l, acc = sum exp(s - m) v) with a polynomial vector exp.
//     The scalar build (no AVX2) uses the per-row Row() instead.
//   * split-K partials (m, l, acc) are merged with log-sum-exp merging:
//       M = max m_s, L = sum l_s e^(m_s - M), out = sum acc_s e^(m_s - M) / L,
//       lse = M + log L.
//   * mass (optional) is a second pass over K of the spans that want it,
//     parallel over key ranges (all kv heads per item) so that each mass
//     element has exactly one writer: p = exp(s - lse) summed over the rows of
//     the key's GQA group.
#include "kernels/cpu/attention.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/tbb_tsan.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace kvtier::kernels {

const char* KernelErrorString(KernelError e) {
  switch (e) {
    case KernelError::kOk:
      return "ok";
    case KernelError::kBadShape:
      return "bad shape";
    case KernelError::kNullPointer:
      return "null pointer";
    case KernelError::kBadDType:
      return "bad dtype";
    case KernelError::kOutOfMemory:
      return "out of memory";
    case KernelError::kDeviceError:
      return "CUDA error";
    case KernelError::kWorkspace:
      return "workspace too small";
  }
  return "unknown kernel error";
}

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// exp(x) for x below this is flushed to exactly 0 (masked scores are -inf).
constexpr float kExpLo = -87.3365447505531f;
constexpr float kExpHi = 80.0f;  // arguments are <= ~0 here; clamp for safety

// ---------------------------------------------------------------------------
// SIMD layer: VF is a vector of kW floats. Three tiers chosen at compile time
// (the build uses -march=native): AVX-512, AVX2+FMA+F16C, scalar.
// ---------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int kW = 16;
using VF = __m512;
inline VF VLoad(const float* p) { return _mm512_loadu_ps(p); }
inline void VStore(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF VSet1(float x) { return _mm512_set1_ps(x); }
inline VF VZero() { return _mm512_setzero_ps(); }
inline VF VAdd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF VSub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF VMul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF VFma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
// GCC 12 reports a false -Wmaybe-uninitialized (bug 105593) for the AVX-512
// intrinsics built on _mm512_undefined_* (max/min, reduce, cast to 256,
// cvtph, ...) once inlined at -O3; the zero-masked forms used here avoid that
// idiom and compile to the same instructions (the all-ones mask folds away).
constexpr __mmask16 kAll = 0xFFFF;
inline VF VMax(VF a, VF b) { return _mm512_maskz_max_ps(kAll, a, b); }
inline VF VMin(VF a, VF b) { return _mm512_maskz_min_ps(kAll, a, b); }
template <bool kIsMax>
inline float VReduce(VF v) {
  auto op = [](VF a, VF b) { return kIsMax ? VMax(a, b) : VAdd(a, b); };
  v = op(v, _mm512_maskz_shuffle_f32x4(kAll, v, v, 0x4E));  // swap 256-bit halves
  v = op(v, _mm512_maskz_shuffle_f32x4(kAll, v, v, 0xB1));  // swap 128-bit lanes
  v = op(v, _mm512_maskz_permute_ps(kAll, v, 0x4E));        // swap 64-bit pairs
  v = op(v, _mm512_maskz_permute_ps(kAll, v, 0xB1));        // swap neighbours
  return _mm512_cvtss_f32(v);
}
inline float VHSum(VF v) { return VReduce<false>(v); }
inline float VHMax(VF v) { return VReduce<true>(v); }
inline VF VRound(VF v) {
  return _mm512_maskz_roundscale_ps(kAll, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline VF VPow2i(VF n) {  // 2^n for integer-valued n in [-126, 127]
  __m512i e = _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll, n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, e, 23));
}
inline VF VZeroBelow(VF x, VF lo, VF r) {  // r where x >= lo, else 0 (also for x = -inf)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), r);
}
// Packed-row helpers (see RowGroup): 128-bit lane l of a vector holds 4
// consecutive values of row l.
inline VF VBcast4(const float* p) { return _mm512_maskz_broadcast_f32x4(kAll, _mm_loadu_ps(p)); }
template <int kImm>
inline VF VShuf(VF a, VF b) {
  return _mm512_maskz_shuffle_ps(kAll, a, b, kImm);
}
template <int kImm>
inline VF VPerm(VF a) {
  return _mm512_maskz_permute_ps(kAll, a, kImm);
}
inline VF VZeroIfNegInf(VF x) {  // x, with -inf replaced by 0
  return _mm512_maskz_mov_ps(
      _mm512_cmp_ps_mask(x, VSet1(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ), x);
}
inline void CvtF16(const uint16_t* s, float* d) {
  _mm512_storeu_ps(d, _mm512_maskz_cvtph_ps(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))));
}
inline void CvtBf16(const uint16_t* s, float* d) {
  __m512i w = _mm512_maskz_cvtepu16_epi32(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  _mm512_storeu_ps(d, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, w, 16)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kW = 8;
using VF = __m256;
inline VF VLoad(const float* p) { return _mm256_loadu_ps(p); }
inline void VStore(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF VSet1(float x) { return _mm256_set1_ps(x); }
inline VF VZero() { return _mm256_setzero_ps(); }
inline VF VAdd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF VSub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF VMul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF VMax(VF a, VF b) { return _mm256_max_ps(a, b); }
inline VF VMin(VF a, VF b) { return _mm256_min_ps(a, b); }
inline VF VFma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline float VHSum(VF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float VHMax(VF v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VF VRound(VF v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VF VPow2i(VF n) {
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline VF VZeroBelow(VF x, VF lo, VF r) { return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), r); }
inline VF VBcast4(const float* p) { return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p)); }
template <int kImm>
inline VF VShuf(VF a, VF b) {
  return _mm256_shuffle_ps(a, b, kImm);
}
template <int kImm>
inline VF VPerm(VF a) {
  return _mm256_permute_ps(a, kImm);
}
inline VF VZeroIfNegInf(VF x) {
  return _mm256_and_ps(_mm256_cmp_ps(x, VSet1(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ), x);
}
inline void CvtF16(const uint16_t* s, float* d) {
  _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
}
inline void CvtBf16(const uint16_t* s, float* d) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  _mm256_storeu_ps(d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
}
#else
#define KVTIER_ATTENTION_SCALAR 1
constexpr int kW = 1;
using VF = float;
inline VF VLoad(const float* p) { return *p; }
inline void VStore(float* p, VF v) { *p = v; }
inline VF VSet1(float x) { return x; }
inline VF VZero() { return 0.0f; }
inline VF VAdd(VF a, VF b) { return a + b; }
inline VF VSub(VF a, VF b) { return a - b; }
inline VF VMul(VF a, VF b) { return a * b; }
inline VF VMax(VF a, VF b) { return a > b ? a : b; }
inline VF VFma(VF a, VF b, VF c) { return std::fma(a, b, c); }
inline float VHSum(VF v) { return v; }
inline float VHMax(VF v) { return v; }
inline void CvtF16(const uint16_t* s, float* d) { *d = F16ToFloat(*s); }
inline void CvtBf16(const uint16_t* s, float* d) { *d = Bf16ToFloat(*s); }
#endif

// exp(x), ~1-2 ulp (Cephes expf polynomial); exactly 0 for x < kExpLo (and -inf).
inline VF VExp(VF x) {
#if defined(KVTIER_ATTENTION_SCALAR)
  return x < kExpLo ? 0.0f : std::exp(std::min(x, kExpHi));
#else
  const VF lo = VSet1(kExpLo);
  const VF xc = VMin(VMax(x, lo), VSet1(kExpHi));
  const VF fx = VRound(VMul(xc, VSet1(1.44269504088896341f)));
  VF r = VFma(fx, VSet1(-0.693359375f), xc);
  r = VFma(fx, VSet1(2.12194440e-4f), r);
  const VF z = VMul(r, r);
  VF y = VSet1(1.9875691500e-4f);
  y = VFma(y, r, VSet1(1.3981999507e-3f));
  y = VFma(y, r, VSet1(8.3334519073e-3f));
  y = VFma(y, r, VSet1(4.1665795894e-2f));
  y = VFma(y, r, VSet1(1.6666665459e-1f));
  y = VFma(y, r, VSet1(5.0000001201e-1f));
  y = VFma(y, z, r);
  y = VAdd(y, VSet1(1.0f));
  return VZeroBelow(x, lo, VMul(y, VPow2i(fx)));
#endif
}

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------------------
// Per-thread scratch (64-byte aligned, grows on demand, reused across calls).
// A work item never blocks on TBB, so an item's scratch cannot be reused by
// another item on the same thread while it runs.
// ---------------------------------------------------------------------------
struct Scratch {
  std::vector<float> f;
  std::vector<int> i;
  float* Floats(size_t n) {
    if (f.size() < n + 16) f.resize(n + 16);
    auto a = reinterpret_cast<uintptr_t>(f.data());
    return reinterpret_cast<float*>((a + 63) & ~uintptr_t{63});
  }
  int* Ints(size_t n) {
    if (i.size() < n) i.resize(n);
    return i.data();
  }
};
thread_local Scratch tls_scratch;

// ---------------------------------------------------------------------------
// Plan: everything a work item needs, computed once per call.
// ---------------------------------------------------------------------------
struct Plan {
  const AttentionParams* p = nullptr;
  int G = 0, D = 0, Dp = 0, nc = 0, T = 0;
  float scale = 0;
  size_t kv_stride = 0;  // elements between consecutive tokens of a span: kv_heads * head_dim
  int rows_total = 0;    // n_queries * q_heads

  // Main pass: items = (kv-head block, query block, key split).
  int HB = 1, n_hblocks = 0;  // kv heads per item (HB divides kv_heads)
  int QB = 0, n_qblocks = 0, S = 1;
  int64_t N = 0, split_len = 0;
  const int64_t* offs = nullptr;  // [n_parts + 1] prefix sums of n_tokens, or null when S == 1
  float* pm = nullptr;            // [S, rows_total] partial max        (S > 1)
  float* pl = nullptr;            // [S, rows_total] partial sum of exp (S > 1)
  float* pacc = nullptr;          // [S, rows_total, D] partial acc     (S > 1)
  float* lse = nullptr;           // [rows_total] final lse (caller's or internal), may be null

  // Mass pass (over the parts with mass only).
  const int* mparts = nullptr;     // [n_mparts] indices into p->parts
  const int64_t* moffs = nullptr;  // [n_mparts + 1] prefix sums
  int n_mparts = 0, S2 = 1;        // items = key splits, each over all kv heads
  int64_t NM = 0, split2_len = 0;
};

// Number of visible keys of a tile [p0, p0 + nk) for a query at position qp.
inline int Visible(int64_t qp, int64_t p0, int nk) {
  if (qp < p0) return 0;
  const uint64_t diff = static_cast<uint64_t>(qp) - static_cast<uint64_t>(p0);
  return diff >= static_cast<uint64_t>(nk) ? nk : static_cast<int>(diff) + 1;
}

// One tile: tokens [t0, t0 + nk) of span parts[pi].
struct TileRef {
  int pi = -1;
  int64_t t0 = 0;
  int nk = 0;
};

// Walks, tile by tile (at most T tokens, never crossing a span), the key range
// [ka, kb) of the concatenation of the n spans parts[idx[i]] (idx null: parts[i])
// whose prefix sums are offs (offs null: the range is everything).
class TileCursor {
 public:
  TileCursor(const KvSpan* parts, const int* idx, int n, const int64_t* offs, int64_t ka, int64_t kb, int T)
      : parts_(parts), idx_(idx), n_(n), offs_(offs), ka_(ka), kb_(kb), T_(T) {
    if (offs_ != nullptr)
      i_ = std::max(0, static_cast<int>(std::upper_bound(offs, offs + n + 1, ka) - offs) - 1);
    LoadSegment();
  }
  bool Next(TileRef* t) {
    if (pi_ < 0) return false;
    t->pi = pi_;
    t->t0 = t_;
    t->nk = static_cast<int>(std::min<int64_t>(T_, tb_ - t_));
    t_ += t->nk;
    if (t_ >= tb_) {
      ++i_;
      LoadSegment();
    }
    return true;
  }

 private:
  void LoadSegment() {  // first non-empty segment at or after i_, or pi_ = -1
    for (pi_ = -1; i_ < n_; ++i_) {
      const int pi = idx_ ? idx_[i_] : i_;
      int64_t ta = 0, tb = parts_[pi].n_tokens;
      if (offs_ != nullptr) {
        if (offs_[i_] >= kb_) return;
        ta = std::max(ka_, offs_[i_]) - offs_[i_];
        tb = std::min(kb_, offs_[i_ + 1]) - offs_[i_];
      }
      if (ta < tb) {
        pi_ = pi;
        t_ = ta;
        tb_ = tb;
        return;
      }
    }
  }
  const KvSpan* parts_;
  const int* idx_;
  int n_;
  const int64_t* offs_;
  int64_t ka_, kb_;
  int T_;
  int i_ = 0, pi_ = -1;
  int64_t t_ = 0, tb_ = 0;
};

// Converts rows [t0, t0 + nk) of kv head g of a span to fp32 into dst (row
// stride Dp, zero padded) -- or, for fp32 storage without padding, returns the
// rows in place. Returns the row pointer; *stride receives the row stride.
template <DType DT, int NCT>
inline const float* Tile(const Plan& pl, const void* base, int64_t t0, int nk, int g, float* dst,
                         size_t* stride) {
  const int D = pl.D, Dp = pl.Dp;
  const size_t first = (static_cast<size_t>(t0) * pl.p->kv_heads + g) * D;
  if constexpr (DT == DType::kF32) {
    if (D == Dp) {
      *stride = pl.kv_stride;
      return static_cast<const float*>(base) + first;
    }
  }
  *stride = Dp;
  if constexpr (DT != DType::kF32 && NCT > 0) {
    if (D == NCT * kW) {  // the common case: whole vectors, trip count known at compile time
      const uint16_t* s = static_cast<const uint16_t*>(base) + first;
      for (int j = 0; j < nk; ++j, s += pl.kv_stride, dst += Dp) {
        for (int c = 0; c < NCT; ++c) {
          if constexpr (DT == DType::kF16)
            CvtF16(s + c * kW, dst + c * kW);
          else
            CvtBf16(s + c * kW, dst + c * kW);
        }
      }
      return dst - static_cast<size_t>(nk) * Dp;
    }
  }
  for (int j = 0; j < nk; ++j) {
    float* d = dst + static_cast<size_t>(j) * Dp;
    int c = 0;
    if constexpr (DT == DType::kF32) {
      const float* s = static_cast<const float*>(base) + first + j * pl.kv_stride;
      std::memcpy(d, s, sizeof(float) * D);
      c = D;
    } else {
      const uint16_t* s = static_cast<const uint16_t*>(base) + first + j * pl.kv_stride;
      for (; c + kW <= D; c += kW) {
        if constexpr (DT == DType::kF16)
          CvtF16(s + c, d + c);
        else
          CvtBf16(s + c, d + c);
      }
      for (; c < D; ++c) d[c] = DT == DType::kF16 ? F16ToFloat(s[c]) : Bf16ToFloat(s[c]);
    }
    for (; c < Dp; ++c) d[c] = 0.0f;
  }
  return dst;
}

// s[j] = q . k_j for j < n (q pre-scaled, both padded to NC vectors); then
// s[n .. RoundUp(n, kW)) = -inf.
template <int NCT>
inline void Scores(const float* q, const float* k, size_t ks, int n, int nc_rt, float* s) {
  if constexpr (NCT > 0) {
    VF qv[NCT];
    for (int c = 0; c < NCT; ++c) qv[c] = VLoad(q + c * kW);
    for (int j = 0; j < n; ++j) {
      const float* kj = k + j * ks;
      VF a = VMul(qv[0], VLoad(kj));
      for (int c = 1; c < NCT; ++c) a = VFma(qv[c], VLoad(kj + c * kW), a);
      s[j] = VHSum(a);
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const float* kj = k + j * ks;
      VF a = VZero();
      for (int c = 0; c < nc_rt; ++c) a = VFma(VLoad(q + c * kW), VLoad(kj + c * kW), a);
      s[j] = VHSum(a);
    }
  }
  const int np = static_cast<int>(RoundUp(n, kW));
  for (int j = n; j < np; ++j) s[j] = kNegInf;
}

// Online-softmax update of one row with n (>= 1) visible keys of a tile.
template <int NCT>
inline void Row(const float* q, float* acc, float* m, float* l, const float* k, size_t ks, const float* v,
                size_t vs, int n, int nc_rt, float* s) {
  Scores<NCT>(q, k, ks, n, nc_rt, s);
  const int np = static_cast<int>(RoundUp(n, kW));
  VF mx = VSet1(kNegInf);
  for (int j = 0; j < np; j += kW) mx = VMax(mx, VLoad(s + j));
  const float tmax = VHMax(mx);
  const float mold = *m;
  const float mnew = std::max(mold, tmax);
  if (!(mnew > kNegInf)) return;  // all scores -inf (or NaN): nothing to add
  const float alpha = mold == mnew ? 1.0f : (mold == kNegInf ? 0.0f : std::exp(mold - mnew));
  const VF mv = VSet1(mnew);
  VF sum = VZero();
  for (int j = 0; j < np; j += kW) {
    const VF e = VExp(VSub(VLoad(s + j), mv));
    VStore(s + j, e);
    sum = VAdd(sum, e);
  }
  *l = *l * alpha + VHSum(sum);
  *m = mnew;
  if constexpr (NCT > 0) {
    VF av[NCT];
    for (int c = 0; c < NCT; ++c) av[c] = VLoad(acc + c * kW);
    if (alpha != 1.0f) {
      const VF a = VSet1(alpha);
      for (int c = 0; c < NCT; ++c) av[c] = VMul(av[c], a);
    }
    for (int j = 0; j < n; ++j) {
      const VF pj = VSet1(s[j]);
      const float* vj = v + j * vs;
      for (int c = 0; c < NCT; ++c) av[c] = VFma(pj, VLoad(vj + c * kW), av[c]);
    }
    for (int c = 0; c < NCT; ++c) VStore(acc + c * kW, av[c]);
  } else {
    if (alpha != 1.0f) {
      const VF a = VSet1(alpha);
      for (int c = 0; c < nc_rt; ++c) VStore(acc + c * kW, VMul(VLoad(acc + c * kW), a));
    }
    for (int j = 0; j < n; ++j) {
      const VF pj = VSet1(s[j]);
      const float* vj = v + j * vs;
      for (int c = 0; c < nc_rt; ++c) VStore(acc + c * kW, VFma(pj, VLoad(vj + c * kW), VLoad(acc + c * kW)));
    }
  }
}

#if !defined(KVTIER_ATTENTION_SCALAR)
// ---------------------------------------------------------------------------
// Packed row-group kernel (SIMD tiers). A row group is kQ = kW / 4 rows of the
// same kv head (4 with AVX-512, 2 with AVX2). The group's queries are packed
// "4 dims x kQ rows" per vector: qp[c] lane l = q_l[4c .. 4c + 3]. A key's 4
// dims are broadcast to every 128-bit lane, so one FMA advances kQ dot
// products, and four keys' partial sums are reduced together by an in-lane
// transpose (6 shuffles + 3 adds for 4 x kQ scores) instead of one horizontal
// reduction per (row, key). Scores, softmax state and exps stay packed:
// sq[jb] lane l = row l's scores of keys 4jb .. 4jb + 3.
// ---------------------------------------------------------------------------
constexpr int kQ = kW / 4;
constexpr bool kGrouped = true;

// z lane l = [sum(x0 lane l), sum(x1 lane l), sum(x2 lane l), sum(x3 lane l)].
inline VF TransposeReduce4(VF x0, VF x1, VF x2, VF x3) {
  const VF y01 = VAdd(VShuf<0x44>(x0, x1), VShuf<0xEE>(x0, x1));
  const VF y23 = VAdd(VShuf<0x44>(x2, x3), VShuf<0xEE>(x2, x3));
  return VAdd(VShuf<0x88>(y01, y23), VShuf<0xDD>(y01, y23));
}
inline VF LaneMax4(VF v) {  // every entry of lane l = max of lane l
  v = VMax(v, VPerm<0x4E>(v));
  return VMax(v, VPerm<0xB1>(v));
}
inline VF LaneSum4(VF v) {
  v = VAdd(v, VPerm<0x4E>(v));
  return VAdd(v, VPerm<0xB1>(v));
}

// Online-softmax update of one row group with the keys of a tile. visr[l]:
// visible keys of row l (0 for padding rows); nvis = max visr >= 1. acc: kQ
// rows of stride Dp. mq / lq: packed running max / sum (entry 4l of row l).
// zero_row: Dp zeros, read instead of keys past nvis in the last key quad.
// Packed scores of a row group for keys [0, 4 * nb) (nb = ceil(nvis / 4)),
// then -inf past each row's visible count (causal mask, padding rows).
template <int NCT>
inline int GroupScores(const float* qp, const int* visr, int nvis, const float* k, size_t ks,
                       const float* zero_row, int nc_rt, float* sq) {
  const int nc4 = (NCT > 0 ? NCT : nc_rt) * kW / 4;  // 4-dim chunks per row
  const int nb = (nvis + 3) / 4;
  for (int jb = 0; jb < nb; ++jb) {
    const int j = 4 * jb;
    const float* k0 = k + j * ks;
    const float* k1 = j + 1 < nvis ? k0 + ks : zero_row;
    const float* k2 = j + 2 < nvis ? k0 + 2 * ks : zero_row;
    const float* k3 = j + 3 < nvis ? k0 + 3 * ks : zero_row;
    VF x0 = VZero(), x1 = VZero(), x2 = VZero(), x3 = VZero();
    for (int c = 0; c < nc4; ++c) {
      const VF q = VLoad(qp + c * kW);
      x0 = VFma(q, VBcast4(k0 + 4 * c), x0);
      x1 = VFma(q, VBcast4(k1 + 4 * c), x1);
      x2 = VFma(q, VBcast4(k2 + 4 * c), x2);
      x3 = VFma(q, VBcast4(k3 + 4 * c), x3);
    }
    VStore(sq + jb * kW, TransposeReduce4(x0, x1, x2, x3));
  }
  for (int l = 0; l < kQ; ++l)
    for (int j = visr[l]; j < 4 * nb; ++j) sq[(j / 4) * kW + 4 * l + j % 4] = kNegInf;
  return nb;
}

// acc rows l < kQ, vectors [c0, c0 + CB): acc = acc * alpha_l + sum over the visible keys j
// of p_lj v_j, the keys in order, one FMA per (row, vector, key). All kQ rows advance together,
// so each key's value vectors are loaded once and the rows' FMA chains interleave (a row at a
// time, a head_dim of 16 is one chain of dependent FMAs, latency-bound).
template <int CB>
inline void RowGroupValues(float* acc, size_t Dp, const float* al, const float* v, size_t vs, const float* sq,
                           int nvis, int c0) {
  VF a[kQ][CB];
  for (int l = 0; l < kQ; ++l) {
    const VF al_l = VSet1(al[4 * l]);
    for (int cb = 0; cb < CB; ++cb) a[l][cb] = VMul(VLoad(acc + l * Dp + (c0 + cb) * kW), al_l);
  }
  for (int j = 0; j < nvis; ++j) {
    const float* vj = v + j * vs + c0 * kW;
    const float* pj = sq + (j / 4) * kW + j % 4;
    VF vv[CB];
    for (int cb = 0; cb < CB; ++cb) vv[cb] = VLoad(vj + cb * kW);
    for (int l = 0; l < kQ; ++l) {
      const VF p = VSet1(pj[4 * l]);
      for (int cb = 0; cb < CB; ++cb) a[l][cb] = VFma(p, vv[cb], a[l][cb]);
    }
  }
  for (int l = 0; l < kQ; ++l)
    for (int cb = 0; cb < CB; ++cb) VStore(acc + l * Dp + (c0 + cb) * kW, a[l][cb]);
}

template <int NCT>
inline void RowGroup(const float* qp, float* acc, size_t Dp, float* mq, float* lq, const int* visr, int nvis,
                     const float* k, size_t ks, const float* v, size_t vs, const float* zero_row, int nc_rt,
                     float* sq) {
  const int nc = NCT > 0 ? NCT : nc_rt;  // vectors per row
  const int nb = GroupScores<NCT>(qp, visr, nvis, k, ks, zero_row, nc_rt, sq);

  VF mx = VSet1(kNegInf);
  for (int jb = 0; jb < nb; ++jb) mx = VMax(mx, VLoad(sq + jb * kW));
  const VF mold = VLoad(mq);
  const VF mnew = VMax(mold, LaneMax4(mx));
  const VF msafe = VZeroIfNegInf(mnew);  // a row with no key so far: exps of -inf give 0
  const VF alpha = VExp(VSub(mold, msafe));
  VF sum = VZero();
  for (int jb = 0; jb < nb; ++jb) {
    const VF e = VExp(VSub(VLoad(sq + jb * kW), msafe));
    VStore(sq + jb * kW, e);
    sum = VAdd(sum, e);
  }
  VStore(lq, VFma(VLoad(lq), alpha, LaneSum4(sum)));
  VStore(mq, mnew);

  alignas(64) float al[kW];
  VStore(al, alpha);
  constexpr int kCB = 4;  // vectors per row per pass: kQ * kCB accumulators in registers
  for (int c0 = 0; c0 < nc; c0 += kCB) {
    switch (std::min(kCB, nc - c0)) {
      case 1:
        RowGroupValues<1>(acc, Dp, al, v, vs, sq, nvis, c0);
        break;
      case 2:
        RowGroupValues<2>(acc, Dp, al, v, vs, sq, nvis, c0);
        break;
      case 3:
        RowGroupValues<3>(acc, Dp, al, v, vs, sq, nvis, c0);
        break;
      default:
        RowGroupValues<kCB>(acc, Dp, al, v, vs, sq, nvis, c0);
        break;
    }
  }
}
#else
constexpr int kQ = 1;
constexpr bool kGrouped = false;
#endif

// Copies one query row (head_dim floats) scaled and zero padded to Dp.
inline void LoadQ(const Plan& pl, int query, int head, float* dst) {
  const float* src = pl.p->q + (static_cast<size_t>(query) * pl.p->q_heads + head) * pl.D;
  int d = 0;
  for (; d < pl.D; ++d) dst[d] = src[d] * pl.scale;
  for (; d < pl.Dp; ++d) dst[d] = 0.0f;
}

// Stores query row `src` (head_dim floats), scaled, as item row r of qs:
// packed (group r / kQ, lane r % kQ: chunk c = d / 4 at
// [(group * Dp / 4 + c) * kW + lane * 4 + d % 4]) or, scalar build, row-major.
// qs must be zeroed first (padding).
inline void StoreQ(const Plan& pl, const float* src, int r, float* qs) {
  const int D = pl.D, Dp = pl.Dp;
  if constexpr (kGrouped) {
    float* dst = qs + static_cast<size_t>(r / kQ) * kQ * Dp + (r % kQ) * 4;
    for (int d = 0; d < D; ++d) dst[(d / 4) * kW + d % 4] = src[d] * pl.scale;
  } else {
    for (int d = 0; d < D; ++d) qs[static_cast<size_t>(r) * Dp + d] = src[d] * pl.scale;
  }
}

// Main pass work item: (kv-head block hblk, query block qb, key split s).
// Item rows: r = gh * Rhp + i * G + hg for kv head g0 + gh, query q0 + i and
// q head (g0 + gh) * G + hg; Rhp = nq * G rounded up to a whole row group
// (padding rows see no key and are never written out).
template <DType DT, int NCT>
void MainItem(const Plan& pl, int item) {
  const AttentionParams& P = *pl.p;
  const int G = pl.G, D = pl.D, Dp = pl.Dp, T = pl.T, HB = pl.HB;
  const int hblk = item % pl.n_hblocks;
  const int rest = item / pl.n_hblocks;
  const int qb = rest % pl.n_qblocks;
  const int s = rest / pl.n_qblocks;
  const int g0 = hblk * HB;
  const int q0 = qb * pl.QB;
  const int nq = std::min(pl.QB, P.n_queries - q0);
  const int Rh = nq * G;
  const int Rhp = static_cast<int>(RoundUp(Rh, kQ));
  const int R = HB * Rhp;
  const int st = kGrouped ? 4 : 1;  // floats of softmax state per row

  const size_t rdp = RoundUp(static_cast<size_t>(R) * Dp, 16);
  const size_t tdp = RoundUp(static_cast<size_t>(T) * Dp, 16);
  const size_t rst = RoundUp(static_cast<size_t>(R) * st, 16);
  const size_t sqn = RoundUp(static_cast<size_t>(T) * kQ + kW, 16);
  float* base = tls_scratch.Floats(2 * rdp + 2 * tdp + 2 * rst + sqn + RoundUp(Dp, 16));
  float* qs = base;
  float* acc = qs + rdp;
  float* kt = acc + rdp;
  float* vt = kt + tdp;
  float* mst = vt + tdp;
  float* lst = mst + rst;
  float* sq = lst + rst;
  float* zero_row = sq + sqn;
  int* ibuf = tls_scratch.Ints(static_cast<size_t>(nq) + R);
  int* vis = ibuf;
  int* visr = ibuf + nq;

  std::fill(qs, qs + static_cast<size_t>(R) * Dp, 0.0f);
  std::fill(acc, acc + static_cast<size_t>(R) * Dp, 0.0f);
  std::fill(mst, mst + static_cast<size_t>(R) * st, kNegInf);
  std::fill(lst, lst + static_cast<size_t>(R) * st, 0.0f);
  std::fill(zero_row, zero_row + Dp, 0.0f);
  for (int gh = 0; gh < HB; ++gh) {
    for (int rh = 0; rh < Rh; ++rh) {
      const int r = gh * Rhp + rh;
      const float* src = P.q + (static_cast<size_t>(q0 + rh / G) * P.q_heads + (g0 + gh) * G + rh % G) * D;
      StoreQ(pl, src, r, qs);
    }
  }

  int64_t qmax = std::numeric_limits<int64_t>::max();
  if (P.causal) {
    qmax = std::numeric_limits<int64_t>::min();
    for (int i = 0; i < nq; ++i) qmax = std::max(qmax, P.q_positions[q0 + i]);
  }
  const int64_t ka = s * pl.split_len;
  const int64_t kb = std::min(pl.N, ka + pl.split_len);

  // No software prefetch: every item streams contiguous runs (a span's tokens,
  // all kv heads of a token for decode), which the hardware prefetchers
  // follow; measured, explicit prefetching of the next tiles was slower.
  TileCursor tiles(P.parts, nullptr, P.n_parts, pl.offs, ka, kb, T);
  TileRef t;
  while (tiles.Next(&t)) {
    const KvSpan& part = P.parts[t.pi];
    const int64_t p0 = part.first_position + t.t0;
    int maxvis = 0;
    if (p0 <= qmax) {  // else: every key of the tile is in the future of every query
      for (int i = 0; i < nq; ++i) {
        vis[i] = P.causal ? Visible(P.q_positions[q0 + i], p0, t.nk) : t.nk;
        maxvis = std::max(maxvis, vis[i]);
      }
    }
    if (maxvis > 0) {
      for (int gh = 0; gh < HB; ++gh) {
        size_t ks = 0, vs = 0;
        const float* kp = Tile<DT, NCT>(pl, part.k, t.t0, maxvis, g0 + gh, kt, &ks);
        const float* vp = Tile<DT, NCT>(pl, part.v, t.t0, maxvis, g0 + gh, vt, &vs);
        for (int r0 = gh * Rhp; r0 < (gh + 1) * Rhp; r0 += kQ) {
          int nvis = 0;
          for (int l = 0; l < kQ; ++l) {
            const int rh = r0 + l - gh * Rhp;
            visr[l] = rh < Rh ? vis[rh / G] : 0;
            nvis = std::max(nvis, visr[l]);
          }
          if (nvis == 0) continue;
          const size_t ro = static_cast<size_t>(r0) * Dp;
          if constexpr (kGrouped) {
            RowGroup<NCT>(qs + ro, acc + ro, Dp, mst + r0 * st, lst + r0 * st, visr, nvis, kp, ks, vp, vs,
                          zero_row, pl.nc, sq);
          } else {
            Row<NCT>(qs + ro, acc + ro, mst + r0, lst + r0, kp, ks, vp, vs, nvis, pl.nc, sq);
          }
        }
      }
    }
  }

  for (int gh = 0; gh < HB; ++gh) {
    for (int rh = 0; rh < Rh; ++rh) {
      const int r = gh * Rhp + rh;
      const int row = (q0 + rh / G) * P.q_heads + (g0 + gh) * G + rh % G;
      const float* a = acc + static_cast<size_t>(r) * Dp;
      const float mr = mst[static_cast<size_t>(r) * st], lr = lst[static_cast<size_t>(r) * st];
      if (pl.S > 1) {
        const size_t pr = static_cast<size_t>(s) * pl.rows_total + row;
        pl.pm[pr] = mr;
        pl.pl[pr] = lr;
        std::memcpy(pl.pacc + pr * D, a, sizeof(float) * D);
        continue;
      }
      float* o = P.out + static_cast<size_t>(row) * D;
      if (lr > 0.0f) {
        const float inv = 1.0f / lr;
        for (int d = 0; d < D; ++d) o[d] = a[d] * inv;
        if (pl.lse) pl.lse[row] = mr + std::log(lr);
      } else {
        std::fill(o, o + D, 0.0f);
        if (pl.lse) pl.lse[row] = kNegInf;
      }
    }
  }
}

// Merges the S split-K partials of rows [r0, r1).
void MergeRows(const Plan& pl, int r0, int r1) {
  const int D = pl.D;
  for (int row = r0; row < r1; ++row) {
    float M = kNegInf;
    for (int s = 0; s < pl.S; ++s) {
      const size_t pr = static_cast<size_t>(s) * pl.rows_total + row;
      if (pl.pl[pr] > 0.0f) M = std::max(M, pl.pm[pr]);
    }
    float* o = pl.p->out + static_cast<size_t>(row) * D;
    std::fill(o, o + D, 0.0f);
    if (!(M > kNegInf)) {
      if (pl.lse) pl.lse[row] = kNegInf;
      continue;
    }
    float L = 0.0f;
    for (int s = 0; s < pl.S; ++s) {
      const size_t pr = static_cast<size_t>(s) * pl.rows_total + row;
      if (!(pl.pl[pr] > 0.0f)) continue;
      const float w = std::exp(pl.pm[pr] - M);
      L += pl.pl[pr] * w;
      const float* a = pl.pacc + pr * D;
      for (int d = 0; d < D; ++d) o[d] += w * a[d];
    }
    const float inv = 1.0f / L;
    for (int d = 0; d < D; ++d) o[d] *= inv;
    if (pl.lse) pl.lse[row] = M + std::log(L);
  }
}

// Mass pass work item: key range s2 of the keys of the mass parts, all kv
// heads (each mass element has exactly one writer). When the packed queries
// of all rows fit in kMassPackFloats, rows go through GroupScores (rows
// r = g * Rhp + i * G + hg, as in MainItem); otherwise row by row.
constexpr size_t kMassPackFloats = size_t{1} << 16;

template <DType DT, int NCT>
void MassItem(const Plan& pl, int item) {
  const AttentionParams& P = *pl.p;
  const int KH = P.kv_heads, G = pl.G, Dp = pl.Dp, T = pl.T, m = P.n_queries;
  const int s2 = item;
  const int Rh = m * G;
  const int Rhp = static_cast<int>(RoundUp(Rh, kQ));
  const size_t qfloats = static_cast<size_t>(KH) * Rhp * Dp;
  const bool packed = kGrouped && qfloats <= kMassPackFloats;
  const size_t tdp = RoundUp(static_cast<size_t>(T) * Dp, 16);
  const size_t sqn = RoundUp(static_cast<size_t>(T) * kQ + kW, 16);
  const size_t qn = RoundUp(packed ? qfloats : static_cast<size_t>(Dp), 16);
  float* base = tls_scratch.Floats(tdp + qn + 2 * sqn + 2 * RoundUp(Dp, 16) + RoundUp(T + kW, 16));
  float* kt = base;
  float* qs = kt + tdp;
  float* sq = qs + qn;
  float* maccq = sq + sqn;  // packed per-lane partial sums (packed path)
  float* zero_row = maccq + sqn;
  float* lsev = zero_row + RoundUp(Dp, 16);  // kW floats: packed lse of a row group
  float* macc = lsev + RoundUp(Dp, 16);      // [T] mass of the tile's keys
  int* vis = tls_scratch.Ints(static_cast<size_t>(m) + kQ);
  int* visr = vis + m;
  std::fill(zero_row, zero_row + Dp, 0.0f);
  if (packed) {
    std::fill(qs, qs + qfloats, 0.0f);
    for (int g = 0; g < KH; ++g)
      for (int rh = 0; rh < Rh; ++rh)
        StoreQ(pl, P.q + (static_cast<size_t>(rh / G) * P.q_heads + g * G + rh % G) * pl.D, g * Rhp + rh, qs);
  }

  int64_t qmax = std::numeric_limits<int64_t>::max();
  if (P.causal) {
    qmax = std::numeric_limits<int64_t>::min();
    for (int i = 0; i < m; ++i) qmax = std::max(qmax, P.q_positions[i]);
  }
  const int64_t ka = s2 * pl.split2_len;
  const int64_t kb = std::min(pl.NM, ka + pl.split2_len);
  TileCursor tiles(P.parts, pl.mparts, pl.n_mparts, pl.moffs, ka, kb, T);
  TileRef t;
  while (tiles.Next(&t)) {
    const KvSpan& part = P.parts[t.pi];
    const int64_t p0 = part.first_position + t.t0;
    int maxvis = 0;
    if (p0 <= qmax) {
      for (int i = 0; i < m; ++i) {
        vis[i] = P.causal ? Visible(P.q_positions[i], p0, t.nk) : t.nk;
        maxvis = std::max(maxvis, vis[i]);
      }
    }
    for (int g = 0; g < KH && maxvis > 0; ++g) {
      size_t ks = 0;
      const float* kp = Tile<DT, NCT>(pl, part.k, t.t0, maxvis, g, kt, &ks);
      std::fill(macc, macc + T, 0.0f);
      if constexpr (kGrouped) {
        if (packed) {
          const int nbmax = (maxvis + 3) / 4;
          std::fill(maccq, maccq + static_cast<size_t>(nbmax) * kW, 0.0f);
          for (int r0 = 0; r0 < Rhp; r0 += kQ) {
            int nvis = 0;
            for (int l = 0; l < kQ; ++l) {
              const int rh = r0 + l;
              visr[l] = rh < Rh ? vis[rh / G] : 0;
              float lse = 0.0f;
              if (visr[l] > 0) {
                lse = pl.lse[(rh / G) * P.q_heads + g * G + rh % G];
                if (!(lse > kNegInf)) visr[l] = 0, lse = 0.0f;  // cannot happen: a visible key gives l >= 1
              }
              for (int x = 0; x < 4; ++x) lsev[4 * l + x] = lse;
              nvis = std::max(nvis, visr[l]);
            }
            if (nvis == 0) continue;
            const int nb = GroupScores<NCT>(qs + static_cast<size_t>(g * Rhp + r0) * Dp, visr, nvis, kp, ks,
                                            zero_row, pl.nc, sq);
            const VF lv = VLoad(lsev);
            for (int jb = 0; jb < nb; ++jb)
              VStore(maccq + jb * kW, VAdd(VLoad(maccq + jb * kW), VExp(VSub(VLoad(sq + jb * kW), lv))));
          }
          for (int jb = 0; jb < nbmax; ++jb)
            for (int l = 0; l < kQ; ++l)
              for (int x = 0; x < 4 && 4 * jb + x < T; ++x) macc[4 * jb + x] += maccq[jb * kW + 4 * l + x];
        }
      }
      if (!packed) {
        for (int i = 0; i < m; ++i) {
          const int n = vis[i];
          if (n == 0) continue;
          const int np = static_cast<int>(RoundUp(n, kW));
          for (int hg = 0; hg < G; ++hg) {
            const int row = i * P.q_heads + g * G + hg;
            const float lse = pl.lse[row];
            if (!(lse > kNegInf)) continue;
            LoadQ(pl, i, g * G + hg, qs);
            Scores<NCT>(qs, kp, ks, n, pl.nc, sq);
            const VF lv = VSet1(lse);
            for (int j = 0; j < np; j += kW)
              VStore(macc + j, VAdd(VLoad(macc + j), VExp(VSub(VLoad(sq + j), lv))));
          }
        }
      }
      float* mass = part.mass + static_cast<size_t>(g) * part.n_tokens + t.t0;
      for (int j = 0; j < maxvis; ++j) mass[j] += macc[j];
    }
  }
}

template <class F>
void ParallelFor(int n, const F& f) {
  if (n <= 0) return;
  if (n == 1) {
    f(0);
    return;
  }
  TsanForkJoin fj;  // the edges oneTBB's uninstrumented library hides from TSan (kernels/tbb_tsan.h)
  tbb::parallel_for(tbb::blocked_range<int>(0, n, 1), fj.Body([&](const tbb::blocked_range<int>& r) {
    for (int i = r.begin(); i < r.end(); ++i) f(i);
  }),
                    tbb::simple_partitioner());
  fj.Join();
}

template <DType DT, int NCT>
void RunMain(const Plan& pl) {
  const int n = pl.n_hblocks * pl.n_qblocks * pl.S;
  ParallelFor(n, [&](int i) { MainItem<DT, NCT>(pl, i); });
}

template <DType DT, int NCT>
void RunMass(const Plan& pl) {
  ParallelFor(pl.S2, [&](int i) { MassItem<DT, NCT>(pl, i); });
}

template <DType DT>
void Dispatch(const Plan& pl, bool mass) {
  // Register-blocked variants for the common padded head dims, a runtime loop otherwise.
#define KVTIER_NC_CASE(N)                           \
  case N:                                           \
    mass ? RunMass<DT, N>(pl) : RunMain<DT, N>(pl); \
    return;
  switch (pl.nc) {
    KVTIER_NC_CASE(1)
    KVTIER_NC_CASE(2)
    KVTIER_NC_CASE(3)
    KVTIER_NC_CASE(4)
    KVTIER_NC_CASE(5)
    KVTIER_NC_CASE(6)
    KVTIER_NC_CASE(8)
    KVTIER_NC_CASE(12)
    KVTIER_NC_CASE(16)
    default:
      mass ? RunMass<DT, 0>(pl) : RunMain<DT, 0>(pl);
      return;
  }
#undef KVTIER_NC_CASE
}

void Run(const Plan& pl, bool mass) {
  switch (pl.p->dtype) {
    case DType::kF32:
      Dispatch<DType::kF32>(pl, mass);
      return;
    case DType::kF16:
      Dispatch<DType::kF16>(pl, mass);
      return;
    case DType::kBF16:
      Dispatch<DType::kBF16>(pl, mass);
      return;
  }
}

KernelError Validate(const AttentionParams& p) {
  if (p.q_heads <= 0 || p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0) return KernelError::kBadShape;
  if (!HeadDimSupported(p.head_dim)) return KernelError::kBadShape;
  if (p.n_queries < 0 || p.n_parts < 0) return KernelError::kBadShape;
  if (!std::isfinite(p.scale)) return KernelError::kBadShape;
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16)
    return KernelError::kBadDType;
  if (p.n_queries == 0) return KernelError::kOk;
  if (p.q == nullptr || p.out == nullptr) return KernelError::kNullPointer;
  if (p.causal && p.q_positions == nullptr) return KernelError::kNullPointer;
  if (p.n_parts > 0 && p.parts == nullptr) return KernelError::kNullPointer;
  // Overflow guards for index arithmetic.
  if (static_cast<int64_t>(p.n_queries) * p.q_heads > std::numeric_limits<int>::max())
    return KernelError::kBadShape;
  for (int i = 0; i < p.n_parts; ++i) {
    const KvSpan& s = p.parts[i];
    if (s.n_tokens < 0) return KernelError::kBadShape;
    if (s.n_tokens == 0) continue;
    if (s.k == nullptr || s.v == nullptr) return KernelError::kNullPointer;
    if (s.first_position > std::numeric_limits<int64_t>::max() - (s.n_tokens - 1))
      return KernelError::kBadShape;
  }
  return KernelError::kOk;
}

KernelError AttentionImpl(const AttentionParams& P) {
  if (const KernelError e = Validate(P); e != KernelError::kOk) return e;
  if (P.n_queries == 0) return KernelError::kOk;

  Plan pl;
  pl.p = &P;
  pl.G = P.q_heads / P.kv_heads;
  pl.D = P.head_dim;
  pl.Dp = static_cast<int>(RoundUp(P.head_dim, kW));
  pl.nc = pl.Dp / kW;
  pl.scale = P.scale != 0.0f ? P.scale : 1.0f / std::sqrt(static_cast<float>(P.head_dim));
  pl.kv_stride = static_cast<size_t>(P.kv_heads) * P.head_dim;
  pl.rows_total = P.n_queries * P.q_heads;
  // Tile: ~2048 floats per converted K (and V) tile, 16..128 tokens, multiple of kW.
  pl.T = static_cast<int>(std::clamp<int64_t>(RoundUp(std::max(1, 2048 / pl.Dp), kW), std::max(16, kW), 128));
  // Rows per item: up to ~128 (fewer for large head dims). A query block has
  // at least one query; the kv-head block takes as many heads as fit so that,
  // for decode, an item reads whole contiguous token rows (all heads) -- the
  // threads then split the key range (split-K) instead of the heads, which
  // keeps each thread's memory stream contiguous.
  const int row_target = std::clamp(16384 / pl.Dp, 16, 128);
  pl.QB = std::max(1, row_target / pl.G);
  pl.n_qblocks = (P.n_queries + pl.QB - 1) / pl.QB;
  {
    const int max_hb = std::max(1, row_target / (std::min(pl.QB, P.n_queries) * pl.G));
    pl.HB = 1;
    for (int hb = std::min(max_hb, P.kv_heads); hb >= 1; --hb)
      if (P.kv_heads % hb == 0) {
        pl.HB = hb;
        break;
      }
    pl.n_hblocks = P.kv_heads / pl.HB;
  }

  int64_t N = 0;
  bool want_mass = false;
  for (int i = 0; i < P.n_parts; ++i) {
    N += P.parts[i].n_tokens;
    if (P.parts[i].n_tokens > 0 && P.parts[i].mass != nullptr) want_mass = true;
  }
  pl.N = N;

  const int threads = std::max(1, tbb::this_task_arena::max_concurrency());
  const int64_t target_items = threads == 1 ? 1 : 4 * static_cast<int64_t>(threads);
  constexpr int64_t kMinSplitKeys = 512;
  int64_t base_items = static_cast<int64_t>(pl.n_hblocks) * pl.n_qblocks;
  if (base_items < target_items && N < 2 * kMinSplitKeys && pl.HB > 1) {
    // Too short to split the keys: parallelise over the heads instead.
    pl.HB = 1;
    pl.n_hblocks = P.kv_heads;
    base_items = static_cast<int64_t>(pl.n_hblocks) * pl.n_qblocks;
  }
  // Equal items, as many as the workers or a multiple: with 5 on 2 workers one runs 3 while the
  // other waits after 2 (a decode step's 2,624 keys), with 4 each runs 2.
  const auto balanced = [threads](int64_t items, int64_t per_item) {
    const int64_t total = items * per_item;
    return total > threads ? std::max<int64_t>(1, total / threads * threads / per_item) : items;
  };
  int64_t S = 1;
  if (base_items < target_items && N >= 2 * kMinSplitKeys) {
    S = std::min((target_items + base_items - 1) / base_items, N / kMinSplitKeys);
    S = std::max<int64_t>(1, std::min<int64_t>(S, std::numeric_limits<int>::max() / base_items));
    S = balanced(S, base_items);
  }
  pl.split_len = RoundUp((N + S - 1) / S, pl.T);
  if (pl.split_len == 0) pl.split_len = 1;
  pl.S = static_cast<int>(std::max<int64_t>(1, (N + pl.split_len - 1) / pl.split_len));

  std::vector<int64_t> offs;
  std::vector<float> partial;
  std::vector<float> lse_internal;
  std::vector<int> mparts;
  std::vector<int64_t> moffs;
  if (pl.S > 1) {
    offs.resize(static_cast<size_t>(P.n_parts) + 1);
    offs[0] = 0;
    for (int i = 0; i < P.n_parts; ++i) offs[i + 1] = offs[i] + P.parts[i].n_tokens;
    pl.offs = offs.data();
    const size_t rs = static_cast<size_t>(pl.S) * pl.rows_total;
    partial.resize(rs * (2 + static_cast<size_t>(pl.D)));
    pl.pm = partial.data();
    pl.pl = pl.pm + rs;
    pl.pacc = pl.pl + rs;
  }
  pl.lse = P.lse;
  if (want_mass && pl.lse == nullptr) {
    lse_internal.resize(pl.rows_total);
    pl.lse = lse_internal.data();
  }

  Run(pl, /*mass=*/false);
  if (pl.S > 1) {
    const int rows = pl.rows_total;
    const int64_t work = static_cast<int64_t>(rows) * pl.S * pl.D;
    const int nblk = work < (1 << 16) ? 1 : std::min(rows, 4 * threads);
    ParallelFor(nblk, [&](int b) {
      const int r0 = static_cast<int>(static_cast<int64_t>(rows) * b / nblk);
      const int r1 = static_cast<int>(static_cast<int64_t>(rows) * (b + 1) / nblk);
      MergeRows(pl, r0, r1);
    });
  }

  if (want_mass) {
    for (int i = 0; i < P.n_parts; ++i)
      if (P.parts[i].n_tokens > 0 && P.parts[i].mass != nullptr) mparts.push_back(i);
    pl.mparts = mparts.data();
    pl.n_mparts = static_cast<int>(mparts.size());
    moffs.resize(mparts.size() + 1);
    moffs[0] = 0;
    for (size_t i = 0; i < mparts.size(); ++i) moffs[i + 1] = moffs[i] + P.parts[mparts[i]].n_tokens;
    pl.moffs = moffs.data();
    pl.NM = moffs.back();
    int64_t S2 = 1;
    if (pl.NM >= 2 * kMinSplitKeys) S2 = balanced(std::min(target_items, pl.NM / kMinSplitKeys), 1);
    pl.split2_len = std::max<int64_t>(1, RoundUp((pl.NM + S2 - 1) / S2, pl.T));
    pl.S2 = static_cast<int>(std::max<int64_t>(1, (pl.NM + pl.split2_len - 1) / pl.split2_len));
    Run(pl, /*mass=*/true);
  }
  return KernelError::kOk;
}

}  // namespace

KernelError Attention(const AttentionParams& params) {
  try {
    return AttentionImpl(params);
  } catch (...) {  // std::bad_alloc from scratch / split-K buffers (possibly rethrown by TBB)
    return KernelError::kOutOfMemory;
  }
}

}  // namespace kvtier::kernels
