// Representative keys by attention mass (InfLLM's rule): the scalar flow that chooses one out
// head's tokens of one chunk, compiled for the host and the device (KVTIER_HOST_DEVICE). The
// store's ChooseRepresentatives (offload/representatives.h, which states the rule) runs it for
// every head; the device seal (kernels/cuda/kernels.h, LaunchChooseMassRepresentatives) runs the
// same source, so a chunk sealed on the device gets the tokens, and the Exact index's row the
// keys and inverse norms, that the host would give it.
//
// Per out head:
//   - with statistics (the head's mass over the chunk sums to > 0): score[t] = mass[t];
//   - without: score[t] = cos(k_t, mean of the unit keys) = <k_t, m> / |k_t|, m = sum_t k_t / |k_t|
//     (the chunk's most typical keys);
//   - the repr_topk best scores, best first, ties to the earlier token.
// Arithmetic in a fixed order with no operation left to a compiler's choice: dots in
// kernels::Dot's order (eight fma lanes, the tail, the lanes in order), the mean as one fma per
// key and element, sqrt and division correctly rounded on both sides. Keys are read in their
// storage dtype and converted exactly to fp32.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/attention.h"  // KernelError
#include "kernels/dtype.h"
#include "kernels/host_device.h"

namespace kvtier::kernels {

/// The keys of one chunk and what to choose from them.
struct MassChoiceShape {
  DType dtype = DType::kF16;
  int kv_heads = 0, head_dim = 0;
  int chunk_size = 0;  ///< tokens
  int repr_topk = 0;   ///< tokens chosen per out head, in [1, chunk_size]
  int out_heads = 0;   ///< a multiple of kv_heads; out head h reads kv head h / (out_heads / kv_heads)
};

/// Scratch floats ChooseMassTokens needs: inverse norms and scores of the tokens, the mean.
KVTIER_HOST_DEVICE inline size_t MassChoiceScratchFloats(const MassChoiceShape& s) {
  return 2 * static_cast<size_t>(s.chunk_size) + static_cast<size_t>(s.head_dim);
}

namespace repr_detail {

KVTIER_HOST_DEVICE inline size_t ElementBytes(DType dt) { return dt == DType::kF32 ? 4 : 2; }

KVTIER_HOST_DEVICE inline float FloatFromBits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

KVTIER_HOST_DEVICE inline float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Exact conversion of element i of a key stored in `dt` (no table: the device has none).
KVTIER_HOST_DEVICE inline float KeyElement(DType dt, const void* key, int i) {
  if (dt == DType::kF32) return static_cast<const float*>(key)[i];
  const uint16_t h = static_cast<const uint16_t*>(key)[i];
  uint32_t bits = 0;
  if (dt == DType::kBF16) {
    bits = static_cast<uint32_t>(h) << 16;
  } else {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) {
      bits = sign | 0x7f800000u | (m << 13);  // inf, NaN (payload kept)
    } else if (e != 0) {
      bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
      bits = sign;
    } else {  // subnormal: m * 2^-24, normalised
      int shift = 0;
      uint32_t mm = m;
      while ((mm & 0x400u) == 0) {
        mm <<= 1;
        ++shift;
      }
      bits = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mm & 0x3ffu) << 13);
    }
  }
  return FloatFromBits(bits);
}

// kernels::Dot's order over a stored key and an fp32 vector (b null: the key with itself).
KVTIER_HOST_DEVICE inline float DotInOrder(DType dt, const void* key, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) {
      const float x = KeyElement(dt, key, i + j);
      acc[j] = Fma(x, b ? b[i + j] : x, acc[j]);
    }
  float s = 0.0f;
  for (; i < n; ++i) {
    const float x = KeyElement(dt, key, i);
    s = Fma(x, b ? b[i] : x, s);
  }
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}

}  // namespace repr_detail

/// 1 / |key| for a stored key (kernels::InverseNorm of its fp32 copy, bit for bit); 0 for zero.
KVTIER_HOST_DEVICE inline float StoredKeyInverseNorm(DType dt, const void* key, int head_dim) {
  const float nk = repr_detail::DotInOrder(dt, key, nullptr, head_dim);
#if defined(__CUDA_ARCH__)
  return nk > 0.0f ? __fdiv_rn(1.0f, __fsqrt_rn(nk)) : 0.0f;
#else
  return nk > 0.0f ? 1.0f / std::sqrt(nk) : 0.0f;
#endif
}

/// Out head `h`'s tokens of one chunk: keys [chunk_size, kv_heads, head_dim] in s.dtype, mass
/// the head's [chunk_size] attention (null: no statistics). Writes the repr_topk chosen tokens,
/// best first, to tokens and every token's score to scratch[0, chunk_size) (scratch holds
/// MassChoiceScratchFloats(s)); returns whether the head had statistics.
KVTIER_HOST_DEVICE inline bool ChooseMassTokens(const MassChoiceShape& s, const void* keys, const float* mass,
                                                int h, float* scratch, int* tokens) {
  const int cs = s.chunk_size, D = s.head_dim, H = s.kv_heads;
  const int kh = h / (s.out_heads / H);
  const size_t key_bytes = static_cast<size_t>(D) * repr_detail::ElementBytes(s.dtype);
  auto key = [&](int t) {
    return static_cast<const uint8_t*>(keys) + (static_cast<size_t>(t) * H + kh) * key_bytes;
  };
  float* score = scratch;
  float* inv_norm = scratch + cs;
  float* mean = scratch + 2 * cs;
  float total = 0.0f;
  if (mass != nullptr)
    for (int t = 0; t < cs; ++t) total += mass[t];
  const bool statistics = total > 0.0f;
  if (statistics) {
    for (int t = 0; t < cs; ++t) score[t] = mass[t];
  } else {
    for (int t = 0; t < cs; ++t) inv_norm[t] = StoredKeyInverseNorm(s.dtype, key(t), D);
    for (int d = 0; d < D; ++d) mean[d] = 0.0f;
    for (int t = 0; t < cs; ++t)
      for (int d = 0; d < D; ++d)
        mean[d] = repr_detail::Fma(repr_detail::KeyElement(s.dtype, key(t), d), inv_norm[t], mean[d]);
    for (int t = 0; t < cs; ++t) {
      const float dot = repr_detail::DotInOrder(s.dtype, key(t), mean, D);
#if defined(__CUDA_ARCH__)
      score[t] = __fmul_rn(dot, inv_norm[t]);
#else
      score[t] = dot * inv_norm[t];
#endif
    }
  }
  // The best repr_topk, best first, ties to the earlier token: rank each token by the tokens
  // that beat it (no sort, no NaN among finite keys and mass).
  for (int t = 0; t < cs; ++t) {
    int rank = 0;
    for (int u = 0; u < cs && rank < s.repr_topk; ++u)
      if (score[u] > score[t] || (score[u] == score[t] && u < t)) ++rank;
    if (rank < s.repr_topk) tokens[rank] = t;
  }
  return statistics;
}

/// One pending chunk's row of an Exact index mirror, chosen on the device (the seal's choice):
/// for each of `chunks` chunks and each out head h, the keys of ChooseMassTokens' tokens (storage
/// bytes, copied) at out_keys + ((h * chunk_stride + c) * repr_topk + r) * key bytes, and their
/// StoredKeyInverseNorm at out_inv_norm[(h * chunk_stride + c) * repr_topk + r]: the layout of
/// kernels::ChunkScoreParams with that chunk_stride.
struct MassRepresentativesParams {
  MassChoiceShape shape;
  int chunks = 0;
  const void* const* keys = nullptr;  ///< [chunks] each chunk's [chunk_size, kv_heads, head_dim] keys
  const float* mass = nullptr;        ///< [chunks, out_heads, chunk_size]; a head of zeros: no statistics
  float* scratch = nullptr;           ///< [chunks, out_heads, MassChoiceScratchFloats]
  int* tokens = nullptr;              ///< [chunks, out_heads, repr_topk] the chosen tokens (written)
  int64_t chunk_stride = 0;           ///< >= chunks
  void* out_keys = nullptr;
  float* out_inv_norm = nullptr;
};

/// The host checks of MassRepresentativesParams (kBadShape, kNullPointer).
inline KernelError MassRepresentativesCheck(const MassRepresentativesParams& p) {
  const MassChoiceShape& s = p.shape;
  if (s.kv_heads <= 0 || s.head_dim <= 0 || s.chunk_size <= 0 || s.repr_topk <= 0 ||
      s.repr_topk > s.chunk_size || s.out_heads < s.kv_heads || s.out_heads % s.kv_heads != 0 ||
      p.chunks < 0 || p.chunk_stride < p.chunks)
    return KernelError::kBadShape;
  if (p.chunks > 0 && (p.keys == nullptr || p.mass == nullptr || p.scratch == nullptr ||
                       p.tokens == nullptr || p.out_keys == nullptr || p.out_inv_norm == nullptr))
    return KernelError::kNullPointer;
  return KernelError::kOk;
}

/// Chunk c, out head h of MassRepresentativesParams (the twin runs it for every pair).
KVTIER_HOST_DEVICE inline void MassRepresentativesOne(const MassRepresentativesParams& p, int c, int h) {
  const MassChoiceShape& s = p.shape;
  const size_t pair = static_cast<size_t>(c) * s.out_heads + h;
  int* tokens = p.tokens + pair * s.repr_topk;
  ChooseMassTokens(s, p.keys[c], p.mass + pair * s.chunk_size, h,
                   p.scratch + pair * MassChoiceScratchFloats(s), tokens);
  const int kh = h / (s.out_heads / s.kv_heads);
  const size_t key_bytes = static_cast<size_t>(s.head_dim) * repr_detail::ElementBytes(s.dtype);
  for (int r = 0; r < s.repr_topk; ++r) {
    const uint8_t* src = static_cast<const uint8_t*>(p.keys[c]) +
                         (static_cast<size_t>(tokens[r]) * s.kv_heads + kh) * key_bytes;
    const size_t at = (static_cast<size_t>(h) * p.chunk_stride + c) * s.repr_topk + r;
    uint8_t* dst = static_cast<uint8_t*>(p.out_keys) + at * key_bytes;
    for (size_t b = 0; b < key_bytes; ++b) dst[b] = src[b];
    p.out_inv_norm[at] = StoredKeyInverseNorm(s.dtype, src, s.head_dim);
  }
}

/// The CPU twin of LaunchChooseMassRepresentatives.
inline KernelError MassRepresentatives(const MassRepresentativesParams& p) {
  if (const KernelError e = MassRepresentativesCheck(p); e != KernelError::kOk) return e;
  for (int c = 0; c < p.chunks; ++c)
    for (int h = 0; h < p.shape.out_heads; ++h) MassRepresentativesOne(p, c, h);
  return KernelError::kOk;
}

}  // namespace kvtier::kernels
