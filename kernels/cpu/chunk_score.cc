#include "kernels/cpu/chunk_score.h"

#include <numeric>
#include <vector>

namespace kvtier::kernels {

KernelError CheckChunkScoreParams(const ChunkScoreParams& p) {
  if (p.kv_heads <= 0 || p.head_dim <= 0 || p.repr <= 0 || p.n_chunks < 0) return KernelError::kBadShape;
  if (p.chunk_stride < 0 || (p.chunk_stride > 0 && p.chunk_stride < p.n_chunks))
    return KernelError::kBadShape;
  if (p.fold != HeadFold::Kind::kSum && p.fold != HeadFold::Kind::kMax) return KernelError::kBadShape;
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16)
    return KernelError::kBadDType;
  if (p.n_chunks == 0) return KernelError::kOk;
  if (p.keys == nullptr || p.inv_norm == nullptr || p.probe == nullptr || p.logit == nullptr ||
      p.cosine == nullptr)
    return KernelError::kNullPointer;
  return KernelError::kOk;
}

KernelError ScoreChunks(const ChunkScoreParams& p) {
  if (const KernelError e = CheckChunkScoreParams(p); e != KernelError::kOk) return e;
  if (p.n_chunks == 0) return KernelError::kOk;
  const size_t n = static_cast<size_t>(p.n_chunks);
  const int H = p.kv_heads, D = p.head_dim, R = p.repr;
  const HeadFold fold(p.fold, H);
  std::fill_n(p.logit, n, fold.Start());
  std::fill_n(p.cosine, n, fold.Start());
  std::vector<float> ip;
  try {
    ip.resize(n * R);
  } catch (const std::bad_alloc&) {
    return KernelError::kOutOfMemory;
  }
  const size_t stride = static_cast<size_t>(ChunkStride(p));
  const size_t head_keys = stride * R * D * DTypeSize(p.dtype);
  for (int h = 0; h < H; ++h) {
    const float* probe = p.probe + static_cast<size_t>(h) * D;
    ScoreChunksOneHead(p.dtype, static_cast<const uint8_t*>(p.keys) + h * head_keys,
                       p.inv_norm + h * stride * R, probe, InverseNorm(probe, D), D, R, 0, n, fold, ip.data(),
                       p.logit, p.cosine);
  }
  return KernelError::kOk;
}

KernelError CheckSegmentedTopKParams(const SegmentedTopKParams& p) {
  if (p.n_segments < 0 || p.k_max < 0) return KernelError::kBadShape;
  if (p.n_segments == 0) return KernelError::kOk;
  if (p.offsets == nullptr || p.k == nullptr || (p.k_max > 0 && p.out_index == nullptr))
    return KernelError::kNullPointer;
  return KernelError::kOk;
}

KernelError SegmentedTopK(const SegmentedTopKParams& p) {
  if (const KernelError e = CheckSegmentedTopKParams(p); e != KernelError::kOk) return e;
  if (p.n_segments == 0) return KernelError::kOk;
  if (p.offsets[0] != 0) return KernelError::kBadShape;
  for (int s = 0; s < p.n_segments; ++s)
    if (p.offsets[s + 1] < p.offsets[s] || p.k[s] < 0 || p.k[s] > p.k_max) return KernelError::kBadShape;
  if (p.scores == nullptr && p.offsets[p.n_segments] > 0) return KernelError::kNullPointer;
  std::vector<int32_t> idx;
  for (int s = 0; s < p.n_segments; ++s) {
    const int32_t n = p.offsets[s + 1] - p.offsets[s];
    const float* sc = p.scores == nullptr ? nullptr : p.scores + p.offsets[s];
    const int32_t take = std::min(n, p.k[s]);
    idx.resize(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    // (score desc, index asc): a strict weak order without NaN; -0.0 == +0.0 compare equal.
    std::partial_sort(idx.begin(), idx.begin() + take, idx.end(),
                      [sc](int32_t a, int32_t b) { return sc[a] > sc[b] || (sc[a] == sc[b] && a < b); });
    int32_t* oi = p.out_index + static_cast<size_t>(s) * p.k_max;
    float* os = p.out_score == nullptr ? nullptr : p.out_score + static_cast<size_t>(s) * p.k_max;
    for (int j = 0; j < p.k_max; ++j) {
      oi[j] = j < take ? idx[j] : -1;
      if (os) os[j] = j < take ? sc[idx[j]] : -std::numeric_limits<float>::infinity();
    }
  }
  return KernelError::kOk;
}

}  // namespace kvtier::kernels
